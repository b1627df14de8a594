// One job: facts, state history, metrics chart, result, spec, per-rank logs, and Cancel.

import { api } from "./api.js";
import { MetricChart } from "./chart.js";
import { StacksCard } from "./stacks_view.js";
import {
  TERMINAL, badge, duration, el, formatNumber, linkJobs, localTime, progressBar, resources, runTime, shortTime, startEstimate,
  worldSize,
} from "./format.js";

const TAILS = [200, 1000, 5000];

export class JobView {
  constructor(id, showError) {
    this.id = id;
    this.showError = showError;
    this.job = null;
    this.log = { rank: 0, stream: "out", tail: 200, follow: true, text: null };
  }

  mount(root) {
    this.head = el("div", { class: "job-head" });
    this.reason = el("div", { class: "reason-box", hidden: true });
    this.progress = el("div", { class: "card progress-card" });
    this.facts = el("dl", { class: "facts" });
    this.chartBox = el("div", { class: "chart-box" });
    this.events = el("tbody");
    this.attempts = el("tbody");
    this.attemptsCard = el("section", { class: "card attempts", hidden: true }, el("h2", {}, "Attempts"),
      el("table", { class: "events" },
        el("thead", {}, el("tr", {}, ["#", "Ended as", "Why", "Nodes", "Scheduler id", "Started", "Ended", "Reason"]
          .map((h) => el("th", {}, h)))),
        this.attempts));
    this.result = el("pre", { class: "json result" }, "—");
    this.spec = el("pre", { class: "json" });
    this.logText = el("pre", { class: "log", tabindex: "0", "aria-label": "log" });
    this.logControls = el("div", { class: "log-controls" });
    this.dialog = this.cancelDialog();
    this.stacks = new StacksCard(this.id, this.showError);
    root.replaceChildren(
      el("a", { href: "#/", class: "back" }, "← All jobs"),
      this.head,
      this.reason,
      this.progress,
      el("div", { class: "grid-2" },
        el("section", { class: "card" }, el("h2", {}, "Details"), this.facts),
        el("section", { class: "card" }, el("h2", {}, "Metrics"), this.chartBox)),
      this.attemptsCard,
      el("div", { class: "grid-2 wide-first" },
        el("section", { class: "card" }, el("h2", {}, "State history"),
          el("table", { class: "events" },
            el("thead", {}, el("tr", {}, ["Time", "Change", "Reason", "Attempt"].map((h) => el("th", {}, h)))),
            this.events)),
        el("section", { class: "card" }, el("h2", {}, "Result"), this.result,
          el("details", { class: "spec" }, el("summary", {}, "Spec"), this.spec))),
      this.stacks.element(),
      el("section", { class: "card logs" }, el("div", { class: "logs-head" }, el("h2", {}, "Logs"), this.logControls),
        this.logText),
      this.dialog,
    );
    this.chart = new MetricChart(this.chartBox, () => this.refreshMetrics().catch((error) => this.showError(error)));
    document.title = `Job ${this.id} · torchyard`;
  }

  unmount() {
    this.chart?.destroy();
  }

  // ---------------------------------------------------------------- polling

  async refresh() {
    const { data: job, changed } = await api.job(this.id);
    if (changed || !this.job) {
      const first = !this.job;
      this.job = job;
      this.renderHead(job);
      this.renderFacts(job);
      this.progress.hidden = !job.progress; // nothing reported (yet): no empty bar to stare at
      this.progress.replaceChildren(progressBar(job), this.latestMetrics(job));
      this.result.textContent = job.result == null ? (TERMINAL.has(job.state) ? "no result" : "not finished yet") : pretty(job.result);
      this.spec.textContent = pretty(job.spec);
      if (first) this.renderLogControls(job);
      this.stacks.update(job);
      // Events and metrics restamp the job, so they can only have changed when the job did.
      await Promise.all([this.refreshEvents(), this.refreshMetrics(), this.refreshAttempts(job)]);
    }
    this.renderDuration(job);
    if (this.log.follow || this.log.text === null) await this.refreshLog();
    if (TERMINAL.has(job.state) && this.log.follow && this.log.sawTerminal) this.setFollow(false);
    this.log.sawTerminal = TERMINAL.has(job.state); // one more read after the end, then stop following
  }

  async refreshEvents() {
    const { data, changed } = await api.events(this.id);
    if (!changed && this.events.children.length) return;
    this.events.replaceChildren(...data.map((e) => el("tr", { dataset: { to: e.to_state } },
      el("td", { class: "when", title: localTime(e.time) }, shortTime(e.time)),
      el("td", { class: "change" }, e.from_state ? badge(e.from_state) : el("span", { class: "muted" }, "new"), " → ", badge(e.to_state)),
      el("td", { class: "reason-cell" }, e.reason ? el("span", { title: e.reason }, e.reason) : el("span", { class: "muted" }, "—")),
      el("td", { class: "num" }, e.attempt))));
  }

  async refreshAttempts(job) {
    // One attempt is the job itself: the table is for jobs that were retried or requeued.
    this.attemptsCard.hidden = job.attempt < 2;
    if (job.attempt < 2) return;
    const { data, changed } = await api.attempts(this.id);
    if (!changed && this.attempts.children.length) return;
    this.attempts.replaceChildren(...data.map((a) => el("tr", { dataset: { attempt: a.attempt } },
      el("td", { class: "num" }, a.attempt),
      el("td", {}, badge(a.state)),
      el("td", {}, a.kind ? a.kind.replace("_", " ") : "—"),
      el("td", {}, a.nodes || "—"),
      el("td", {}, a.external_id || "—"),
      el("td", { class: "when", title: localTime(a.started_at) }, a.started_at ? shortTime(a.started_at) : "—"),
      el("td", { class: "when", title: localTime(a.ended_at) }, a.ended_at ? shortTime(a.ended_at) : "—"),
      el("td", { class: "reason-cell" }, a.reason ? el("span", { title: a.reason }, a.reason) : el("span", { class: "muted" }, "—")))));
  }

  async refreshMetrics() {
    // The shown range at about a point per pixel, however long the run: the server downsamples
    // (keeping each slice's lowest and highest point) and answers 304 while the job is unchanged.
    const { data } = await api.metricSeries(this.id, this.chart.pointsWanted, this.chart.zoom);
    this.chart.show(data);
  }

  // ---------------------------------------------------------------- head, facts

  renderHead(job) {
    const cancellable = !TERMINAL.has(job.state);
    this.head.replaceChildren(...[
      el("div", { class: "title" },
        el("h1", {}, job.name), el("span", { class: "muted id" }, `#${job.id}`), badge(job.state),
        job.stalled_at ? el("span", { class: "stalled-flag", title: `stalled since ${localTime(job.stalled_at)}` }, "stalled") : null,
        job.cancel_requested && cancellable ? el("span", { class: "muted" }, "cancelling…") : null),
      cancellable
        ? el("button", { type: "button", class: "button danger", dataset: { action: "cancel" }, onclick: () => this.confirmCancel() },
          "Cancel job")
        : null,
    ].filter(Boolean));
    const loud = job.reason && !["running", "succeeded"].includes(job.state);
    this.reason.hidden = !loud && !job.stalled_at;
    if (job.stalled_at) { // the watchdog's flag: which rank is where (text only, never markup)
      this.reason.className = "reason-box reason-stalled";
      this.reason.replaceChildren(el("strong", {}, `Stalled since ${localTime(job.stalled_at)}`),
        el("pre", {}, job.stall_reason || ""));
    } else if (loud) {
      this.reason.className = `reason-box reason-${job.state}`;
      // What it waits for, or the dependency that cancelled it: each job named there is a link.
      const dependencies = job.state === "waiting" || job.reason.startsWith("dependency job");
      this.reason.replaceChildren(el("strong", {}, headline(job)), el("pre", {}, dependencies ? linkJobs(job.reason) : job.reason));
    }
  }

  renderFacts(job) {
    const target = job.spec.entrypoint || job.spec.script || "—";
    const rows = [
      ["Owner", job.owner], ["Runs as", job.run_as || "—"], ["Backend", job.backend], ["Scheduler id", job.external_id || "—"],
      ["Nodes × tasks", resources(job)], ["Runs on", job.nodes || "—"], ["Ranks", placementText(job.placement)],
      ["Attempt", attemptText(job)],
      ["Restarts", restartsText(job)],
      ["Goodput", goodputBar(job)],
      ["Target", el("code", {}, target)],
      // One element for the view's life: the facts are redrawn on every change, an open list stays open.
      ["Code", job.spec.code ? (this.codeBox ??= this.codeFiles(job.spec.code)) : "—"],
      ["Interpreter", job.spec.python ? el("code", {}, job.spec.python) : "the service's job Python"],
      ["Created", localTime(job.created_at)], ["Submitted", localTime(job.submitted_at)],
      ["Started", localTime(job.started_at)], ["Finished", localTime(job.finished_at)],
      ["Run time", el("span", { class: "run-time" }, duration(runTime(job)))],
      ["Expected start", startEstimate(job) || "—"],
      ["Exit code", job.exit_code ?? "—"], ["Checkpoint", job.latest_checkpoint ? el("code", {}, job.latest_checkpoint) : "—"],
      ["Disk", el("span", { class: "disk" }, diskText(job))],
    ];
    if (job.sweep_id != null) {
      const params = Object.entries(job.params || {}).map(([k, v]) => `${k}=${v}`).join(" ");
      rows.splice(3, 0, ["Sweep", el("span", {}, el("a", { href: `#/sweeps/${job.sweep_id}` }, `#${job.sweep_id}`), ` ${params}`)]);
    }
    if (job.pipeline_id != null) {
      rows.splice(3, 0, ["Pipeline", el("span", { class: "pipeline-ref" }, "stage ", el("code", {}, job.stage ?? "?"), " of ",
        el("a", { href: `#/pipelines/${job.pipeline_id}` }, `pipeline #${job.pipeline_id}`))]);
    }
    this.facts.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k), el("dd", {}, v)]));
  }

  // The snapshot's id, and its files once opened (read once: a snapshot never changes).
  codeFiles(codeId) {
    const list = el("ul", { class: "code-files" });
    const box = el("details", { class: "code", dataset: { code: codeId } },
      el("summary", { title: codeId }, el("code", {}, `${codeId.slice(0, 19)}…`)), list);
    box.addEventListener("toggle", async () => {
      if (!box.open || list.children.length) return;
      try {
        const { data } = await api.code(codeId);
        list.replaceChildren(...data.paths.map((path) => el("li", {}, el("code", {}, path))),
          ...(data.files > data.paths.length ? [el("li", { class: "muted" }, `… ${data.files - data.paths.length} more`)] : []));
      } catch (error) {
        list.replaceChildren(el("li", { class: "muted" }, error.status === 404 ? "no longer stored" : error.message));
      }
    });
    return box;
  }

  renderDuration(job) {
    const node = this.facts.querySelector(".run-time");
    if (node) node.textContent = duration(runTime(job));
  }

  latestMetrics(job) {
    const metrics = (job.progress && job.progress.metrics) || {};
    const when = job.progress && job.progress.time ? new Date(job.progress.time * 1000).toLocaleTimeString() : null;
    return el("div", { class: "latest" },
      Object.entries(metrics).map(([k, v]) => el("span", { class: "metric" }, el("span", { class: "muted" }, k), " ", formatNumber(v))),
      when ? el("span", { class: "muted" }, `reported ${when}`) : null);
  }

  // ---------------------------------------------------------------- logs

  renderLogControls(job) {
    const ranks = Array.from({ length: worldSize(job) }, (_, r) => r);
    const rank = el("select", { "aria-label": "rank", name: "rank", onchange: () => { this.log.rank = Number(rank.value); this.reloadLog(); } },
      ranks.map((r) => el("option", { value: r }, `rank ${r}`)));
    const stream = el("select", { "aria-label": "stream", name: "stream", onchange: () => { this.log.stream = stream.value; this.reloadLog(); } },
      el("option", { value: "out" }, "stdout"), el("option", { value: "err" }, "stderr"));
    const tail = el("select", { "aria-label": "lines", name: "tail", onchange: () => { this.log.tail = Number(tail.value); this.reloadLog(); } },
      TAILS.map((n) => el("option", { value: n }, `last ${n} lines`)));
    this.followBox = el("input", { type: "checkbox", name: "follow", checked: this.log.follow,
      onchange: () => { this.setFollow(this.followBox.checked); if (this.log.follow) this.reloadLog(); } });
    this.logControls.replaceChildren(rank, stream, tail, el("label", { class: "follow" }, this.followBox, " follow"));
    if (job.state === "failed") {
      // The worker logs (and tracebacks) go to stderr; stdout holds what the task printed.
      this.log.stream = "err";
      stream.value = "err";
    }
    if (TERMINAL.has(job.state)) this.setFollow(false);
  }

  setFollow(on) {
    this.log.follow = on;
    if (this.followBox) this.followBox.checked = on;
  }

  reloadLog() {
    this.log.text = null;
    this.refreshLog().catch((error) => this.showError(error));
  }

  async refreshLog() {
    const { rank, stream, tail } = this.log;
    const { data } = await api.logs(this.id, rank, stream, tail);
    if (rank !== this.log.rank || stream !== this.log.stream) return; // the user switched meanwhile
    const box = this.logText;
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 24;
    if (data !== this.log.text) {
      this.log.text = data;
      box.textContent = data || `(rank ${rank} has written nothing to ${stream === "out" ? "stdout" : "stderr"} yet)`;
      box.classList.toggle("empty", !data);
      if (this.log.follow || atBottom) box.scrollTop = box.scrollHeight;
    }
  }

  // ---------------------------------------------------------------- cancel

  cancelDialog() {
    this.dialogMessage = el("p", {});
    const dialog = el("dialog", { class: "confirm", "aria-label": "confirm cancel" },
      el("h2", {}, "Cancel this job?"), this.dialogMessage,
      el("form", { method: "dialog", class: "actions" },
        el("button", { type: "submit", value: "keep", class: "button" }, "Keep running"),
        el("button", { type: "submit", value: "cancel", class: "button danger", dataset: { action: "confirm-cancel" } }, "Cancel job")));
    dialog.addEventListener("close", async () => {
      if (dialog.returnValue !== "cancel") return;
      try {
        await api.cancel(this.id);
        await this.refresh();
      } catch (error) {
        this.showError(error);
      }
    });
    return dialog;
  }

  confirmCancel() {
    this.dialogMessage.textContent = `"${this.job.name}" (#${this.id}) will be stopped on every rank. This cannot be undone.`;
    this.dialog.returnValue = "";
    this.dialog.showModal();
  }
}

// "0-3 on n1 (GPUs 0,1,2,3); 4-7 on n2": each host's ranks, as the ranks reported them.
function placementText(placement) {
  if (!placement || !placement.length) return "—";
  const hosts = new Map();
  for (const p of placement) hosts.set(p.host, [...(hosts.get(p.host) || []), p]);
  return [...hosts].map(([host, ranks]) => {
    const numbers = ranks.map((p) => p.rank);
    const run = numbers.length > 1 && numbers.every((n, i) => n === numbers[0] + i);
    const gpus = ranks.filter((p) => p.gpu != null).map((p) => p.gpu);
    return `${run ? `${numbers[0]}-${numbers.at(-1)}` : numbers.join(",")} on ${host}${gpus.length ? ` (GPUs ${gpus.join(",")})` : ""}`;
  }).join("; ");
}

function attemptText(job) {
  const most = job.retries && job.retries.max ? ` of at most ${1 + job.retries.max}` : "";
  return `${job.attempt}${most}`;
}

// Restarts in place (issue 44): how many, under which policy; each is in the state history.
function restartsText(job) {
  const policy = job.restarts || { max: 0, on: [] };
  if (!job.restart_count && !policy.max) return "none";
  return `${job.restart_count || 0} in place (at most ${policy.max} an attempt, on ${policy.on.join(", ") || "nothing"})`;
}

// The job's wall time split (the service works it out at each start, end and restart), the part it
// accrues brought up to now: a stacked bar, each part's seconds in its title and the legend.
const GOODPUT_PARTS = [["training", "running", "training"], ["downtime", "failed", "restart downtime"],
  ["recomputed", "timeout", "recomputed"], ["queue", "queued", "queue"]];

function goodputBar(job) {
  const kept = job.goodput;
  if (!kept || !kept.as_of) return "—"; // not worked out yet (a job from before goodput)
  const seconds = Object.fromEntries(GOODPUT_PARTS.map(([part]) => [part, kept[`${part}_s`] || 0]));
  if (kept.accruing && kept.as_of) seconds[kept.accruing] += Math.max(0, (Date.now() - Date.parse(kept.as_of)) / 1000);
  const wall = Object.values(seconds).reduce((a, b) => a + b, 0);
  if (wall <= 0) return "—";
  const parts = GOODPUT_PARTS.filter(([part]) => seconds[part] > 0);
  const label = ([part, , name]) => `${name} ${duration(seconds[part] * 1000)}`;
  return el("div", { class: "progress goodput", style: "flex-wrap: wrap", dataset: { training: Math.round(100 * seconds.training / wall) } },
    el("div", { class: "bar", style: "display: flex; min-width: 120px" }, ...parts.map((one) => el("div", {
      class: `fill part-${one[0]}`, title: label(one),
      style: `width: ${(100 * seconds[one[0]] / wall).toFixed(2)}%; border-radius: 0; --c: var(--${one[1]})`,
    }))),
    el("span", { class: "label", style: "white-space: normal" }, `${Math.round(100 * seconds.training / wall)}% training`,
      el("span", { class: "pct" }, ` · ${parts.filter(([part]) => part !== "training").map(label).join(" · ") || "nothing lost"}`)));
}

// The job folder's size as the service last measured it (when the job ended, and hourly while it
// runs), or what retention removed of it.
function diskText(job) {
  if (job.folder_removed_at) return `folder removed ${localTime(job.folder_removed_at)} (retention)`;
  if (job.folder_bytes == null) return "not measured yet";
  const size = bytesText(job.folder_bytes);
  const kept = job.files_removed_at ? `, logs only since ${localTime(job.files_removed_at)}` : "";
  return `${size} (measured ${localTime(job.folder_measured_at)}${kept})`;
}

function bytesText(bytes) {
  const units = ["B", "KB", "MB", "GB", "TB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1000 && unit < units.length - 1) {
    value /= 1000;
    unit += 1;
  }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

function pretty(value) {
  return JSON.stringify(value, null, 2);
}

function headline(job) {
  const code = job.exit_code != null ? ` (exit code ${job.exit_code})` : "";
  return {
    waiting: "Waiting for other jobs", failed: `Failed${code}`, timeout: "Ran out of time", cancelled: "Cancelled", pending: "Waiting in the scheduler's queue",
    queued: "Not dispatched yet", submitted: "Submitted", preempted: "Preempted", requeued: "Requeued",
    retrying: `Retrying: attempt ${job.attempt} goes out ${job.retry_at ? `at ${new Date(job.retry_at).toLocaleTimeString()}` : "soon"}`,
  }[job.state] || job.state;
}
