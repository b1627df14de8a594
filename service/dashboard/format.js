// Small pure helpers: states, times in the browser's zone, durations, safe DOM building.

import { serverNow } from "./api.js";
import { STATES, TERMINAL } from "./states.js"; // written by the service from service/states.py

export { STATES, TERMINAL };
export const ACTIVE = STATES.filter((s) => !TERMINAL.has(s));

// el("td", {class: "x", title: "y"}, child, "text", ...): children are nodes or text, never HTML,
// so a job name or a log line can never inject markup.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value == null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child == null || child === false) continue;
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

export function badge(state) {
  return el("span", { class: `badge state-${state}`, "data-state": state }, state);
}

export function localTime(iso) {
  return iso ? new Date(iso).toLocaleString() : "—";
}

export function shortTime(iso) {
  if (!iso) return "—";
  const when = new Date(iso);
  const sameDay = new Date(serverNow()).toDateString() === when.toDateString();
  return sameDay ? when.toLocaleTimeString() : when.toLocaleString();
}

export function duration(ms) {
  if (ms == null || Number.isNaN(ms)) return "—";
  const s = Math.max(0, Math.round(ms / 1000));
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  const h = Math.floor(m / 60);
  if (h < 48) return `${h}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(h / 24)}d ${h % 24}h`;
}

export function ago(iso) {
  return iso ? `${duration(serverNow() - Date.parse(iso))} ago` : "—";
}

// How long the job has run (or ran): started -> finished, or -> now while it runs.
export function runTime(job) {
  if (!job.started_at) return null;
  const end = job.finished_at ? Date.parse(job.finished_at) : serverNow();
  return end - Date.parse(job.started_at);
}

export function resources(job) {
  const r = (job.spec && job.spec.resources) || {};
  const nodes = r.nodes || 1;
  const tasks = r.tasks_per_node || 1;
  const gpus = r.gpus_per_node ? ` · ${r.gpus_per_node} GPU/node` : "";
  return `${nodes} × ${tasks}${gpus}`;
}

export function worldSize(job) {
  const r = (job.spec && job.spec.resources) || {};
  return (r.nodes || 1) * (r.tasks_per_node || 1);
}

export function progressBar(job) {
  const p = job.progress;
  const done = job.state === "succeeded";
  if (!p || !p.total) {
    return el("div", { class: "progress empty" }, done ? "done" : p ? `step ${p.step}` : "—");
  }
  // A finished job is done whatever its last report said (a task may report its last step early).
  const fraction = done ? 1 : Math.min(1, Math.max(0, p.step / p.total));
  const pct = Math.round(fraction * 100);
  const label = done && p.step < p.total ? ["done"] : [`${p.step}/${p.total}`, el("span", { class: "pct" }, ` ${pct}%`)];
  return el(
    "div",
    { class: `progress state-${job.state}`, title: `step ${p.step} of ${p.total}`, "data-step": p.step },
    el("div", { class: "bar" }, el("div", { class: "fill", style: `width:${pct}%` })),
    el("span", { class: "label" }, ...label),
  );
}

export function formatNumber(value) {
  if (value == null || !Number.isFinite(value)) return "—";
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return Number(value.toPrecision(4)).toString();
}

// "starts in about 12 min, reason: Resources": SLURM's own estimate for a job waiting in its queue.
export function startEstimate(job) {
  if (!["pending", "requeued"].includes(job.state) || !job.expected_start_at) return null;
  const minutes = Math.round((Date.parse(job.expected_start_at) - serverNow()) / 60000);
  const when = minutes < 1 ? "starts any moment"
    : minutes < 120 ? `starts in about ${minutes} min` : `starts in about ${duration(minutes * 60000)}`;
  return job.reason ? `${when}, reason: ${job.reason}` : when;
}

// "waiting for job 12 to succeed, job 14 to end": the text, each "job <id>" a link to that job's page.
export function linkJobs(text) {
  return String(text).split(/\b(job \d+)\b/).map((part, i) =>
    i % 2 ? el("a", { href: `#/jobs/${part.slice(4)}`, class: "job-ref" }, part) : part).filter((part) => part !== "");
}
