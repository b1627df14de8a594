// A hand-drawn SVG line chart for a job's metrics: axes with ticks and labels, one line per metric,
// a legend that toggles lines, a second y axis when scales differ, a hover readout, and zoom (drag
// across steps; double-click to see the whole run again).

const SVG = "http://www.w3.org/2000/svg";
const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#65a30d"];
const HEIGHT = 300;
const MARGIN = { top: 16, right: 64, bottom: 42, left: 64 };

function svg(tag, attrs = {}, text) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text != null) node.textContent = text;
  return node;
}

// "Nice" ticks: steps of 1, 2 or 5 times a power of ten, covering [min, max].
export function niceTicks(min, max, count = 5) {
  if (!(max > min)) {
    const pad = Math.abs(min) * 0.1 || 1;
    [min, max] = [min - pad, max + pad];
  }
  const raw = (max - min) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const ticks = [Math.floor(min / step) * step];
  while (ticks[ticks.length - 1] < max - step * 1e-9) ticks.push(ticks[ticks.length - 1] + step);
  const clean = ticks.map((v) => Number(v.toPrecision(12)));
  return { ticks: clean, lo: clean[0], hi: clean[clean.length - 1] };
}

function label(value) {
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e5)) return value.toExponential(1);
  return Number(value.toPrecision(4)).toString();
}

function magnitude(range) {
  return Math.max(Math.abs(range.min), Math.abs(range.max)) || 1;
}

export class MetricChart {
  // onZoom({from, to} or null): the caller fetches that range again, at this chart's resolution.
  constructor(container, onZoom = () => {}) {
    this.container = container;
    this.onZoom = onZoom;
    this.zoom = null;
    this.series = new Map(); // name -> Map("attempt:step" -> {step, value, attempt})
    this.hidden = new Set();
    this.wrap = document.createElement("div");
    this.wrap.className = "chart-wrap";
    this.legend = document.createElement("div");
    this.legend.className = "legend";
    this.tooltip = document.createElement("div");
    this.tooltip.className = "chart-tooltip";
    this.tooltip.hidden = true;
    this.wrap.append(this.tooltip);
    container.replaceChildren(this.legend, this.wrap);
    this.resizeObserver = new ResizeObserver(() => this.render());
    this.resizeObserver.observe(container);
  }

  // page: GET /jobs/{id}/metrics?points=N, each series (a metric of one attempt) at most N points.
  show(page) {
    this.series = new Map();
    for (const { name, attempt, steps, values } of page.series) {
      if (!this.series.has(name)) this.series.set(name, new Map());
      const points = this.series.get(name);
      steps.forEach((step, i) => points.set(`${attempt}:${step}`, { step, value: values[i], attempt }));
    }
    this.render();
  }

  get pointCount() {
    let n = 0;
    for (const points of this.series.values()) n += points.size;
    return n;
  }

  // About one point per pixel of the plot: what to ask the server for.
  get pointsWanted() {
    const width = (this.container.clientWidth || 720) - MARGIN.left - MARGIN.right;
    return Math.min(4000, Math.max(100, Math.round(width)));
  }

  names() {
    // loss first (what people look for), then the rest alphabetically: stable colours per name.
    return [...this.series.keys()].sort((a, b) => (a === "loss" ? -1 : b === "loss" ? 1 : a.localeCompare(b)));
  }

  color(name) {
    return COLORS[this.names().indexOf(name) % COLORS.length];
  }

  sorted(name) {
    return [...this.series.get(name).values()].sort((a, b) => a.attempt - b.attempt || a.step - b.step);
  }

  render() {
    const names = this.names();
    this.container.dataset.points = String(this.pointCount); // what tests (and curious people) read
    this.renderLegend(names);
    this.wrap.querySelector("svg")?.remove();
    const visible = names.filter((n) => !this.hidden.has(n));
    const width = Math.max(320, this.container.clientWidth || 720);
    const chart = svg("svg", {
      class: "chart", width, height: HEIGHT, viewBox: `0 0 ${width} ${HEIGHT}`, role: "img",
      "aria-label": `metrics chart: ${names.join(", ") || "no data"}`,
    });
    this.wrap.prepend(chart);
    if (!visible.length) {
      chart.append(svg("text", { x: width / 2, y: HEIGHT / 2, class: "chart-empty", "text-anchor": "middle" },
        names.length ? "all metrics hidden — click one in the legend" : "no metrics reported yet"));
      return;
    }
    const data = new Map(visible.map((n) => [n, this.sorted(n)]));
    const axes = this.assignAxes(visible, data);
    const plot = { x0: MARGIN.left, x1: width - (axes.right ? MARGIN.right : 24), y0: MARGIN.top, y1: HEIGHT - MARGIN.bottom };
    const steps = [...data.values()].flat().map((p) => p.step);
    const xs = niceTicks(Math.min(...steps), Math.max(...steps), Math.max(2, Math.floor((plot.x1 - plot.x0) / 90)));
    const x = (step) => plot.x0 + ((step - xs.lo) / (xs.hi - xs.lo || 1)) * (plot.x1 - plot.x0);
    const scales = {};
    for (const side of ["left", "right"]) {
      if (!axes[side]) continue;
      const ticks = niceTicks(axes[side].min, axes[side].max, 5);
      scales[side] = { ...ticks, y: (v) => plot.y1 - ((v - ticks.lo) / (ticks.hi - ticks.lo || 1)) * (plot.y1 - plot.y0) };
    }
    this.drawGrid(chart, plot, xs, x, scales, axes);
    for (const name of visible) {
      const y = scales[axes.of[name]].y;
      chart.append(svg("path", { d: this.path(data.get(name), x, y), class: "line", stroke: this.color(name), "data-metric": name }));
      if (data.get(name).length <= 40) {
        for (const p of data.get(name)) chart.append(svg("circle", { cx: x(p.step), cy: y(p.value), r: 2.5, fill: this.color(name) }));
      }
    }
    this.hover(chart, plot, x, xs, data, scales, axes);
  }

  // Metrics of similar size share the left axis; the rest share a right one (e.g. loss vs. lr).
  assignAxes(visible, data) {
    const ranges = new Map(visible.map((n) => {
      const values = data.get(n).map((p) => p.value);
      return [n, { min: Math.min(...values), max: Math.max(...values) }];
    }));
    const base = magnitude(ranges.get(visible[0]));
    const of = {};
    const sides = {};
    for (const name of visible) {
      const ratio = magnitude(ranges.get(name)) / base;
      const side = ratio > 0.2 && ratio < 5 ? "left" : "right";
      of[name] = side;
      const r = ranges.get(name);
      sides[side] = sides[side]
        ? { min: Math.min(sides[side].min, r.min), max: Math.max(sides[side].max, r.max), names: [...sides[side].names, name] }
        : { ...r, names: [name] };
    }
    return { of, left: sides.left, right: sides.right };
  }

  path(points, x, y) {
    let d = "";
    let attempt = null;
    for (const p of points) {
      // A new attempt (a resumed run) starts a new stroke instead of joining the old one.
      d += `${attempt === p.attempt ? "L" : "M"}${x(p.step).toFixed(1)},${y(p.value).toFixed(1)}`;
      attempt = p.attempt;
    }
    return d;
  }

  drawGrid(chart, plot, xs, x, scales, axes) {
    const grid = svg("g", { class: "grid" });
    for (const t of xs.ticks) {
      grid.append(svg("line", { x1: x(t), x2: x(t), y1: plot.y0, y2: plot.y1 }));
      grid.append(svg("text", { x: x(t), y: plot.y1 + 16, "text-anchor": "middle", class: "tick" }, label(t)));
    }
    for (const [side, scale] of Object.entries(scales)) {
      const left = side === "left";
      for (const t of scale.ticks) {
        if (left) grid.append(svg("line", { x1: plot.x0, x2: plot.x1, y1: scale.y(t), y2: scale.y(t) }));
        grid.append(svg("text", {
          x: left ? plot.x0 - 8 : plot.x1 + 8, y: scale.y(t) + 4, "text-anchor": left ? "end" : "start", class: "tick",
        }, label(t)));
      }
      const cx = left ? 16 : plot.x1 + MARGIN.right - 12;
      const cy = (plot.y0 + plot.y1) / 2;
      grid.append(svg("text", {
        x: cx, y: cy, transform: `rotate(-90 ${cx} ${cy})`, "text-anchor": "middle", class: "axis-label",
      }, axes[side].names.join(", ")));
    }
    grid.append(svg("rect", { x: plot.x0, y: plot.y0, width: plot.x1 - plot.x0, height: plot.y1 - plot.y0, class: "frame" }));
    grid.append(svg("text", { x: (plot.x0 + plot.x1) / 2, y: HEIGHT - 6, "text-anchor": "middle", class: "axis-label" }, "step"));
    chart.append(grid);
  }

  hover(chart, plot, x, xs, data, scales, axes) {
    const cursor = svg("line", { class: "cursor", y1: plot.y0, y2: plot.y1, visibility: "hidden" });
    const zone = svg("rect", { x: plot.x0, y: plot.y0, width: plot.x1 - plot.x0, height: plot.y1 - plot.y0, class: "hover-zone" });
    const band = svg("rect", { class: "zoom-band", y: plot.y0, height: plot.y1 - plot.y0, visibility: "hidden" });
    chart.append(cursor, band, zone);
    const stepAt = (event) => {
      const px = event.clientX - chart.getBoundingClientRect().left;
      return Math.round(xs.lo + ((px - plot.x0) / (plot.x1 - plot.x0)) * (xs.hi - xs.lo));
    };
    let dragFrom = null;
    zone.addEventListener("mousedown", (event) => { dragFrom = stepAt(event); });
    zone.addEventListener("mouseup", (event) => {
      if (dragFrom == null) return; // the press began outside the plot
      const [from, to] = [dragFrom, stepAt(event)].sort((a, b) => a - b);
      dragFrom = null;
      band.setAttribute("visibility", "hidden");
      if (to - from < 2) return; // a click, not a drag
      this.zoom = { from: Math.max(0, from), to };
      this.onZoom(this.zoom);
    });
    zone.addEventListener("dblclick", () => {
      this.zoom = null;
      this.onZoom(null);
    });
    zone.addEventListener("mouseleave", () => {
      dragFrom = null;
      band.setAttribute("visibility", "hidden");
      cursor.setAttribute("visibility", "hidden");
      this.tooltip.hidden = true;
    });
    zone.addEventListener("mousemove", (event) => {
      const box = chart.getBoundingClientRect();
      const px = event.clientX - box.left;
      const step = xs.lo + ((px - plot.x0) / (plot.x1 - plot.x0)) * (xs.hi - xs.lo);
      const rows = [];
      let nearest = null;
      for (const [name, points] of data) {
        const p = points.reduce((best, q) => (Math.abs(q.step - step) < Math.abs(best.step - step) ? q : best));
        nearest = nearest == null || Math.abs(p.step - step) < Math.abs(nearest - step) ? p.step : nearest;
        rows.push([name, p]);
      }
      if (dragFrom != null) {
        const [a, b] = [x(dragFrom), x(stepAt(event))].sort((p, q) => p - q);
        band.setAttribute("x", Math.max(plot.x0, a));
        band.setAttribute("width", Math.max(0, Math.min(plot.x1, b) - Math.max(plot.x0, a)));
        band.setAttribute("visibility", "visible");
      }
      cursor.setAttribute("x1", x(nearest));
      cursor.setAttribute("x2", x(nearest));
      cursor.setAttribute("visibility", "visible");
      this.tooltip.replaceChildren();
      const head = document.createElement("div");
      head.className = "tip-head";
      head.textContent = `step ${nearest}`;
      this.tooltip.append(head);
      for (const [name, p] of rows) {
        const line = document.createElement("div");
        line.innerHTML = `<i style="background:${this.color(name)}"></i>`;
        line.append(`${name}: ${label(p.value)}${p.step === nearest ? "" : ` (step ${p.step})`}`);
        this.tooltip.append(line);
      }
      this.tooltip.hidden = false;
      const left = Math.min(px + 14, box.width - this.tooltip.offsetWidth - 4);
      this.tooltip.style.left = `${left}px`;
      this.tooltip.style.top = `${plot.y0 + 8}px`;
    });
  }

  renderLegend(names) {
    this.legend.replaceChildren(...names.map((name) => {
      const points = this.sorted(name);
      const last = points[points.length - 1];
      const button = document.createElement("button");
      button.type = "button";
      button.className = "legend-item";
      button.dataset.metric = name;
      button.setAttribute("aria-pressed", String(!this.hidden.has(name)));
      button.title = this.hidden.has(name) ? `show ${name}` : `hide ${name}`;
      button.innerHTML = `<i style="background:${this.color(name)}"></i>`;
      const value = document.createElement("b");
      value.textContent = last ? label(last.value) : "";
      button.append(`${name} `, value);
      button.addEventListener("click", () => {
        if (this.hidden.has(name)) this.hidden.delete(name);
        else this.hidden.add(name);
        this.render();
      });
      return button;
    }));
  }

  destroy() {
    this.resizeObserver.disconnect();
  }
}
