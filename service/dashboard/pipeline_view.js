// Pipelines: the list (#/pipelines) and one pipeline (#/pipelines/4): its stages drawn as boxes in
// columns by depth in the `after` graph, an arrow from each stage to every stage that runs after it,
// each box coloured by its state and linked to its job or sweep.

import { api } from "./api.js";
import { ago, badge, el, linkJobs, localTime } from "./format.js";

const SVG = "http://www.w3.org/2000/svg";
const BOX = { width: 190, height: 66 };
const GAP = { x: 70, y: 22 };
const PAD = 14;
const LANE = 8; // between the lanes above the boxes that arrows skipping a column run along
const NAME_CHARS = 21;
const QUIET_REASONS = new Set(["running", "succeeded"]); // their job's reason ("completed") is noise

// What a stage waits for, or why it ended as it did; nothing where all is well.
function reasonOf(stage) {
  return QUIET_REASONS.has(stage.state) ? null : stage.reason;
}

function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG, tag);
  for (const [key, value] of Object.entries(attrs)) if (value != null) node.setAttribute(key, value);
  for (const child of children.flat()) {
    if (child == null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function countsText(stages) {
  const counts = new Map();
  for (const stage of stages) counts.set(stage.state, (counts.get(stage.state) || 0) + 1);
  return [...counts].map(([state, count]) => `${count} ${state}`).join(", ");
}

function stageLink(stage) {
  if (stage.job_id != null) return { href: `#/jobs/${stage.job_id}`, text: `job #${stage.job_id}` };
  if (stage.sweep_id != null) return { href: `#/sweeps/${stage.sweep_id}`, text: `sweep #${stage.sweep_id}` };
  return null;
}

// Each stage's column (its depth: 0 without `after`, else one more than its deepest upstream) and
// row (its order among its column's stages, as the stages were given), and where its box lies;
// `lanes` leaves room above the boxes for that many arrows that skip a column.
export function layout(stages, lanes = 0) {
  const byName = new Map(stages.map((s) => [s.name, s]));
  const depth = new Map();
  const depthOf = (name, path) => {
    if (depth.has(name)) return depth.get(name);
    if (path.has(name)) return 0; // a cycle: the API refuses them, this only keeps the page alive
    path.add(name);
    const upstream = byName.get(name).after.filter((n) => byName.has(n));
    const d = upstream.length ? 1 + Math.max(...upstream.map((n) => depthOf(n, path))) : 0;
    path.delete(name);
    depth.set(name, d);
    return d;
  };
  const columns = [];
  for (const stage of [...stages].sort((a, b) => a.position - b.position)) {
    const d = depthOf(stage.name, new Set());
    (columns[d] ||= []).push(stage);
  }
  const rows = Math.max(1, ...columns.map((c) => (c ? c.length : 0)));
  const height = rows * BOX.height + (rows - 1) * GAP.y;
  const top = PAD + lanes * LANE;
  const boxes = new Map();
  columns.forEach((column, col) => {
    const offset = (height - (column.length * BOX.height + (column.length - 1) * GAP.y)) / 2; // centred
    column.forEach((stage, row) => {
      boxes.set(stage.name, {
        stage, col, x: PAD + col * (BOX.width + GAP.x), y: top + offset + row * (BOX.height + GAP.y),
      });
    });
  });
  return {
    boxes,
    width: PAD * 2 + columns.length * BOX.width + (columns.length - 1) * GAP.x,
    height: top + height + PAD,
  };
}

// Right edge to left edge. To the next column, one curve; further on, up through the gap after the
// first column, along its own lane above every box, and down through the gap before the last one:
// never across another box.
function arrowPath(from, to, lane) {
  const [x1, y1, x2, y2] = [from.x + BOX.width, from.y + BOX.height / 2, to.x - 2, to.y + BOX.height / 2];
  if (lane == null) {
    const bend = GAP.x / 2;
    return `M${x1},${y1} C${x1 + bend},${y1} ${x2 - bend},${y2} ${x2},${y2}`;
  }
  const [out, into, y] = [x1 + GAP.x / 2 - 4, to.x - GAP.x / 2 + 4, PAD + lane * LANE];
  return `M${x1},${y1} H${out} V${y} H${into} V${y2} H${x2}`;
}

function stageBox({ stage, x, y }) {
  const link = stageLink(stage);
  const name = stage.name.length > NAME_CHARS ? `${stage.name.slice(0, NAME_CHARS - 1)}…` : stage.name;
  const detail = [link ? link.text : `${stage.kind}: not made yet`, stage.runs > 1 ? `run ${stage.runs}` : null]
    .filter(Boolean).join(" · ");
  const title = `${stage.name} (${stage.kind}): ${stage.state}${reasonOf(stage) ? `\n${reasonOf(stage)}` : ""}`;
  const box = svg("g", { class: `stage state-${stage.state}`, "data-stage": stage.name, "data-state": stage.state },
    svg("title", {}, title),
    svg("rect", { x, y, width: BOX.width, height: BOX.height, rx: 8 }),
    svg("text", { x: x + 12, y: y + 21, class: "stage-name" }, name),
    svg("circle", { cx: x + 16, cy: y + 36, r: 4, class: "stage-dot" }),
    svg("text", { x: x + 26, y: y + 40, class: "stage-state" }, stage.state),
    svg("text", { x: x + 12, y: y + 57, class: "stage-detail" }, detail));
  return link ? svg("a", { href: link.href, class: "stage-link" }, box) : box;
}

export function pipelineGraph(stages) {
  const names = new Set(stages.map((s) => s.name));
  const edges = stages.flatMap((s) => s.after.filter((n) => names.has(n)).map((upstream) => [upstream, s.name]));
  const columns = layout(stages).boxes; // a first pass for the columns: which arrows skip one
  const skips = edges.filter(([a, b]) => columns.get(b).col - columns.get(a).col > 1);
  const { boxes, width, height } = layout(stages, skips.length);
  const arrows = edges.map(([upstream, name]) => {
    const lane = skips.findIndex(([a, b]) => a === upstream && b === name);
    return svg("path", { class: `arrow${lane < 0 ? "" : " skip"}`, d: arrowPath(boxes.get(upstream), boxes.get(name), lane < 0 ? null : lane),
      "data-from": upstream, "data-to": name, "marker-end": "url(#pipeline-arrowhead)" });
  });
  return svg("svg", { class: "pipeline-graph", width, height, viewBox: `0 0 ${width} ${height}`, role: "img",
    "aria-label": `${stages.length} stages` },
  svg("defs", {}, svg("marker", { id: "pipeline-arrowhead", viewBox: "0 0 10 10", refX: 9, refY: 5,
    markerWidth: 7, markerHeight: 7, orient: "auto-start-reverse" }, svg("path", { d: "M0,0 L10,5 L0,10 z" }))),
  arrows, [...boxes.values()].map(stageBox));
}

// ---------------------------------------------------------------- the list

export class PipelinesView {
  mount(root) {
    this.body = el("tbody");
    root.replaceChildren(
      el("div", { class: "page-head" }, el("h1", {}, "Pipelines")),
      el("section", { class: "card" },
        el("table", { class: "jobs pipelines" },
          el("thead", {}, el("tr", {}, ["ID", "Name", "State", "Stages", "Owner", "Created"].map((h) => el("th", {}, h)))),
          this.body)),
    );
    document.title = "Pipelines · torchyard";
  }

  async refresh() {
    const { data, changed } = await api.pipelines();
    if (!changed && this.body.children.length) return;
    this.body.replaceChildren(...(data.items.length ? data.items.map((p) => el("tr", { dataset: { pipeline: p.id } },
      el("td", {}, el("a", { href: `#/pipelines/${p.id}` }, `#${p.id}`)),
      el("td", {}, el("a", { href: `#/pipelines/${p.id}` }, p.name)),
      el("td", {}, badge(p.state)),
      el("td", { class: "muted" }, `${p.stages.length}: ${countsText(p.stages)}`),
      el("td", {}, p.owner),
      el("td", { class: "muted", title: localTime(p.created_at) }, ago(p.created_at)),
    )) : [el("tr", {}, el("td", { colspan: 6, class: "muted" }, "No pipelines yet: POST /api/v1/pipelines."))]));
  }
}

// ---------------------------------------------------------------- one pipeline

export class PipelineView {
  constructor(id) {
    this.id = id;
    this.shown = null; // the JSON last drawn: a poll that brings nothing new redraws nothing
  }

  mount(root) {
    this.head = el("div", { class: "pipeline-head" });
    this.graph = el("div", { class: "pipeline-box" });
    this.stages = el("tbody");
    root.replaceChildren(
      el("a", { href: "#/pipelines", class: "back" }, "← All pipelines"),
      this.head,
      el("section", { class: "card" }, el("h2", {}, "Stages"), this.graph),
      el("section", { class: "card" }, el("table", { class: "jobs stages" },
        el("thead", {}, el("tr", {}, ["Stage", "Runs after", "State", "Job or sweep", "Reason"].map((h) => el("th", {}, h)))),
        this.stages)),
    );
    document.title = `Pipeline ${this.id} · torchyard`;
  }

  async refresh() {
    const { data: pipeline } = await api.pipeline(this.id);
    const text = JSON.stringify(pipeline);
    if (text === this.shown) return;
    this.shown = text;
    this.renderHead(pipeline);
    this.graph.replaceChildren(pipelineGraph(pipeline.stages));
    this.renderStages(pipeline.stages);
  }

  renderHead(p) {
    this.head.replaceChildren(...[
      el("div", { class: "title" }, el("h1", {}, p.name), el("span", { class: "muted id" }, `#${p.id}`), badge(p.state)),
      el("p", { class: "muted" }, `owner ${p.owner} · created ${localTime(p.created_at)}`,
        p.finished_at ? ` · finished ${localTime(p.finished_at)}` : "", ` · ${countsText(p.stages)}`),
      p.reason ? el("div", { class: `reason-box reason-${p.state}` }, el("pre", {}, linkJobs(p.reason))) : null,
    ].filter(Boolean));
  }

  renderStages(stages) {
    this.stages.replaceChildren(...[...stages].sort((a, b) => a.position - b.position).map((s) => {
      const link = stageLink(s);
      return el("tr", { dataset: { stage: s.name } },
        el("td", {}, el("code", {}, s.name)),
        el("td", { class: "muted" }, s.after.length ? `${s.after.join(", ")}${s.on === "succeeded" ? "" : ` (${s.on})`}` : "—"),
        el("td", {}, badge(s.state)),
        el("td", {}, link ? el("a", { href: link.href }, link.text) : "—", s.runs > 1 ? el("span", { class: "muted" }, ` · run ${s.runs}`) : null),
        el("td", { class: "reason-cell" }, reasonOf(s) ? linkJobs(reasonOf(s)) : el("span", { class: "muted" }, "—")));
    }));
  }
}
