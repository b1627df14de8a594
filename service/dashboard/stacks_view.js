// The "Stacks" card of a job's page: every rank's stacks, captured when Capture is pressed (a running
// job), or the last capture kept. What the ranks wrote reaches the page as text only: el() appends
// text nodes, and nothing here sets innerHTML.

import { api } from "./api.js";
import { TERMINAL, el, localTime, shortTime } from "./format.js";

export class StacksCard {
  constructor(id, showError) {
    this.id = id;
    this.showError = showError;
    this.busy = false;
    this.lastLoaded = false;
  }

  element() {
    this.status = el("span", { class: "muted stacks-status" }, "");
    this.button = el("button", {
      type: "button", class: "button", dataset: { action: "capture-stacks" }, onclick: () => this.capture(),
    }, "Capture");
    this.body = el("div", { class: "stacks-body" },
      el("p", { class: "muted" }, "Capture shows where every rank of the running job is, each thread's stack."));
    return el("section", { class: "card stacks", dataset: { card: "stacks" } },
      el("div", { class: "stacks-head" }, el("h2", {}, "Stacks"), this.status, this.button), this.body);
  }

  // The job changed: Capture only while it runs; an ended job shows its last capture, read once.
  update(job) {
    this.running = job.state === "running";
    this.button.disabled = this.busy || !this.running;
    if (TERMINAL.has(job.state) && !this.lastLoaded) {
      this.lastLoaded = true;
      this.load(false);
    }
  }

  capture() {
    return this.load(true);
  }

  async load(now) {
    this.busy = true;
    this.button.disabled = true;
    this.status.textContent = now ? "capturing…" : "";
    try {
      const { data } = await api.stacks(this.id, now);
      this.render(data);
      this.status.textContent = "";
    } catch (error) {
      if (error.status === 409) this.status.textContent = error.message;
      else this.showError(error);
    } finally {
      this.busy = false;
      this.button.disabled = !this.running;
    }
  }

  render(capture) {
    const hosts = new Map(capture.ranks.map((r) => [r.rank, r.host]));
    const groups = capture.groups.map((group, index) => {
      const where = [...new Set(group.ranks.map((r) => hosts.get(r)).filter(Boolean))].join(", ");
      const title = `${group.ranks.length === 1 ? "rank" : "ranks"} ${group.label}${where ? ` on ${where}` : ""}`;
      return el("details", { class: "stack-group", open: index === 0, dataset: { ranks: group.label } },
        el("summary", {}, title),
        el("pre", { class: "stack-text" }, group.threads.map(threadText).join("\n\n")));
    });
    const notes = capture.ranks.filter((r) => r.note).map((r) =>
      el("li", { dataset: { rank: r.rank } }, `rank ${r.rank}: ${r.note}`));
    this.body.replaceChildren(...[
      el("p", { class: "stacks-summary" }, capture.summary || "no stacks"),
      el("p", { class: "muted", title: localTime(capture.captured_at) },
        `${capture.fresh ? "captured" : "last capture"} ${shortTime(capture.captured_at)} · attempt ${capture.attempt} · `
        + `${capture.trigger} · ${capture.took_s.toFixed(2)} s`),
      ...groups,
      notes.length ? el("ul", { class: "stack-notes" }, ...notes) : null,
    ].filter(Boolean));
  }
}

function threadText(thread) {
  const head = `thread ${thread.name}${thread.current ? " (current)" : ""}, most recent call first:`;
  return [head, ...thread.frames.map((f) => `  ${f.file}:${f.line} ${f.function}`)].join("\n");
}
