// Sweeps: the list (#/sweeps) and one sweep (#/sweeps/12): every trial's curve of the sweep's metric
// on one uPlot chart (a colour per trial, its parameters in the legend, hover and drag-to-zoom), and a
// table of the trials that sorts by any column.

import uPlot from "./vendor/uplot/uPlot.esm.js";
import { api } from "./api.js";
import { TERMINAL, ago, badge, el, formatNumber } from "./format.js";

const COLORS = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#db2777", "#0891b2", "#65a30d",
  "#4b5563", "#b91c1c", "#1d4ed8", "#047857"];
const HEIGHT = 340;

export function paramsText(params) {
  return Object.entries(params).map(([name, value]) => `${name}=${value}`).join(" ");
}

function countsText(counts) {
  return Object.entries(counts).map(([state, count]) => `${count} ${state}`).join(", ") || "no trials";
}

// ---------------------------------------------------------------- the list

export class SweepsView {
  mount(root) {
    this.body = el("tbody");
    root.replaceChildren(
      el("div", { class: "page-head" }, el("h1", {}, "Sweeps")),
      el("section", { class: "card" },
        el("table", { class: "jobs sweeps" },
          el("thead", {}, el("tr", {}, ["ID", "Name", "Trials", "State", "Best", "Trials by state", "Created"]
            .map((h) => el("th", {}, h)))),
          this.body)),
    );
    document.title = "Sweeps · torchyard";
  }

  async refresh() {
    const { data, changed } = await api.sweeps();
    if (!changed && this.body.children.length) return;
    this.body.replaceChildren(...(data.items.length ? data.items.map((sweep) => el("tr", {},
      el("td", {}, el("a", { href: `#/sweeps/${sweep.id}` }, `#${sweep.id}`)),
      el("td", {}, el("a", { href: `#/sweeps/${sweep.id}` }, sweep.name)),
      el("td", {}, String(sweep.size)),
      el("td", {}, sweep.state),
      el("td", {}, sweep.best ? `${sweep.metric} ${formatNumber(sweep.best.metric_last)} (job ${sweep.best.job_id})` : "—"),
      el("td", { class: "muted" }, countsText(sweep.counts)),
      el("td", { class: "muted" }, ago(sweep.created_at)),
    )) : [el("tr", {}, el("td", { colspan: 7, class: "muted" }, "No sweeps yet: POST /api/v1/sweeps or torchyard sweep FILE."))]));
  }
}

// ---------------------------------------------------------------- one sweep

const COLUMNS = [
  { key: "job_id", title: "Job", value: (t) => t.job_id },
  { key: "params", title: "Parameters", value: (t) => paramsText(t.params) },
  { key: "state", title: "State", value: (t) => t.state },
  { key: "metric_last", title: "Last", value: (t) => t.metric_last },
  { key: "metric_best", title: "Best", value: (t) => t.metric_best },
];

export class SweepView {
  constructor(id) {
    this.id = id;
    this.sweep = null;
    this.curves = new Map(); // job id -> {steps: [], values: [], last: step or null, done: bool}
    this.sort = { key: "metric_best", ascending: true };
    this.plot = null;
  }

  mount(root) {
    this.head = el("div", { class: "job-head" });
    this.chartBox = el("div", { class: "sweep-chart" });
    this.table = el("table", { class: "jobs trials" });
    root.replaceChildren(
      el("a", { href: "#/sweeps", class: "back" }, "← All sweeps"),
      this.head,
      el("section", { class: "card" }, el("h2", { class: "metric-title" }, "Metric"), this.chartBox),
      el("section", { class: "card" }, el("h2", {}, "Trials"), this.table),
    );
    this.resize = () => this.plot?.setSize({ width: this.width(), height: HEIGHT });
    window.addEventListener("resize", this.resize);
    document.title = `Sweep ${this.id} · torchyard`;
  }

  unmount() {
    window.removeEventListener("resize", this.resize);
    this.plot?.destroy();
  }

  width() {
    return Math.max(320, this.chartBox.clientWidth || 800);
  }

  async refresh() {
    const { data: sweep, changed } = await api.sweep(this.id);
    if (!changed && this.sweep) return;
    const first = !this.sweep;
    this.sweep = sweep;
    if (first) this.sort.ascending = sweep.goal !== "max";
    this.renderHead(sweep);
    await this.loadCurves(sweep);
    this.renderChart(sweep);
    this.renderTable(sweep);
  }

  renderHead(sweep) {
    const goal = sweep.goal === "max" ? "highest" : "lowest";
    const best = sweep.best
      ? el("a", { href: `#/jobs/${sweep.best.job_id}` }, `job ${sweep.best.job_id} (${paramsText(sweep.best.params)})`)
      : "none yet";
    this.head.replaceChildren(
      el("h1", {}, `Sweep #${sweep.id} `, el("span", { class: "muted" }, sweep.name)),
      el("p", { class: "muted" }, `${sweep.size} trials on ${sweep.backend}`,
        sweep.max_parallel ? `, at most ${sweep.max_parallel} at once` : "", ` · ${countsText(sweep.counts)}`),
      el("p", { class: "best" }, `Best (${goal} last ${sweep.metric}): `, best),
    );
    this.chartBox.previousSibling.textContent = sweep.metric;
  }

  // Each trial's new points of the metric since the last read; a trial that has ended is read once more.
  // A trial without any point yet (metric_last is null: most of a throttled sweep's, waiting their
  // turn) is not asked at all, so a refresh asks about the trials under way, not every trial.
  async loadCurves(sweep) {
    const reads = sweep.trials.map(async (trial) => {
      const curve = this.curves.get(trial.job_id) || { steps: [], values: [], last: null, done: false };
      this.curves.set(trial.job_id, curve);
      if (curve.done) return;
      if (trial.metric_last == null) {
        curve.done = TERMINAL.has(trial.state); // ended without a point: it will have none
        return;
      }
      // From the last step on: a step can be reported twice (a train loss, then the epoch's
      // evaluation), and the later value is the one the trial ended that step with.
      const { data } = await api.trialMetric(trial.job_id, sweep.metric, curve.last == null ? null : curve.last - 1);
      for (const point of data) {
        if (curve.last != null && point.step < curve.last) continue;
        if (point.step === curve.last) {
          curve.values[curve.values.length - 1] = point.value;
          continue;
        }
        curve.steps.push(point.step);
        curve.values.push(point.value);
        curve.last = point.step;
      }
      curve.done = TERMINAL.has(trial.state);
    });
    await Promise.all(reads);
  }

  // uPlot wants one x array: the union of every trial's steps, each series null where it has no point.
  chartData(sweep) {
    const steps = [...new Set(sweep.trials.flatMap((t) => this.curves.get(t.job_id).steps))].sort((a, b) => a - b);
    const index = new Map(steps.map((step, i) => [step, i]));
    const series = sweep.trials.map((trial) => {
      const values = new Array(steps.length).fill(null);
      const curve = this.curves.get(trial.job_id);
      curve.steps.forEach((step, i) => { values[index.get(step)] = curve.values[i]; });
      return values;
    });
    return [steps, ...series];
  }

  renderChart(sweep) {
    const data = this.chartData(sweep);
    // For people and tests alike: how many points the chart holds, and for how many trials.
    this.chartBox.dataset.points = String(data.slice(1).reduce((n, s) => n + s.filter((v) => v != null).length, 0));
    this.chartBox.dataset.trials = String(sweep.trials.length);
    const key = sweep.trials.map((t) => t.job_id).join(",");
    if (this.plot && this.plotKey === key) {
      this.plot.setData(data, false); // keep the user's zoom while points arrive
      // Only over two steps or more: a scale from one step to itself (or from none to none) sends
      // uPlot's axis into an endless tick loop ("Invalid array length"); it ranges one step itself.
      const steps = data[0];
      if (!this.zoomed && steps.length > 1) this.plot.setScale("x", { min: steps[0], max: steps[steps.length - 1] });
      return;
    }
    this.plot?.destroy();
    this.plotKey = key;
    this.zoomed = false;
    const options = {
      width: this.width(),
      height: HEIGHT,
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { label: sweep.metric }],
      cursor: { drag: { x: true, y: false } },
      legend: { live: true },
      hooks: { setSelect: [() => { this.zoomed = true; }] },
      series: [
        { label: "step" },
        ...sweep.trials.map((trial, i) => ({
          label: `#${trial.job_id} ${paramsText(trial.params)}`,
          stroke: COLORS[i % COLORS.length],
          width: 1.5,
          spanGaps: true,
          value: (u, v) => (v == null ? "—" : formatNumber(v)),
        })),
      ],
    };
    this.plot = new uPlot(options, data, this.chartBox);
    this.chartBox.addEventListener("dblclick", () => { this.zoomed = false; });
  }

  renderTable(sweep) {
    const { key, ascending } = this.sort;
    const column = COLUMNS.find((c) => c.key === key);
    const rows = [...sweep.trials].sort((a, b) => {
      const [x, y] = [column.value(a), column.value(b)];
      if (x == null || y == null) return (x == null) - (y == null); // no value yet: always last
      return (x < y ? -1 : x > y ? 1 : 0) * (ascending ? 1 : -1);
    });
    const colour = new Map(sweep.trials.map((t, i) => [t.job_id, COLORS[i % COLORS.length]]));
    const head = el("tr", {}, ...COLUMNS.map((c) => {
      const arrow = c.key === key ? (ascending ? " ▲" : " ▼") : "";
      const th = el("th", { class: "sortable", "data-key": c.key, "aria-sort": c.key === key ? (ascending ? "ascending" : "descending") : "none" },
        c.key.startsWith("metric") ? `${c.title} ${sweep.metric}` : c.title, arrow);
      th.addEventListener("click", () => {
        this.sort = { key: c.key, ascending: c.key === key ? !ascending : true };
        this.renderTable(sweep);
      });
      return th;
    }));
    const best = sweep.best && sweep.best.job_id;
    this.table.replaceChildren(el("thead", {}, head), el("tbody", {}, ...rows.map((t) => el("tr", { "data-job": t.job_id, class: t.job_id === best ? "best-trial" : "" },
      el("td", {}, el("span", { class: "swatch", style: `background:${colour.get(t.job_id)}` }), " ",
        el("a", { href: `#/jobs/${t.job_id}` }, `#${t.job_id}`)),
      el("td", { class: "params" }, paramsText(t.params)),
      el("td", {}, badge(t.state)),
      el("td", { class: "num" }, t.metric_last == null ? "—" : formatNumber(t.metric_last)),
      el("td", { class: "num" }, t.metric_best == null ? "—" : formatNumber(t.metric_best)),
    ))));
  }
}
