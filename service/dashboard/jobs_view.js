// The jobs table: newest first, filtered by state and name, paged by cursor, refreshed by polling.

import { api } from "./api.js";
import {
  ACTIVE, STATES, TERMINAL, ago, badge, duration, el, localTime, progressBar, resources, runTime, startEstimate,
} from "./format.js";

const PAGE_SIZES = [25, 50, 100, 200];
const MIN_NAME = 3; // the service finds names by substrings this long or longer (`?name=`), refuses shorter
const searchable = (name) => [...name].length >= MIN_NAME; // characters, as the service counts them
const EXCEPTION_LINE = /^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b/; // "RuntimeError: ..."
const QUIET_REASONS = new Set(["running", "succeeded"]); // their reason ("completed") is noise

export class JobsView {
  // query: URLSearchParams from the hash (#/?state=running&name=x&cursor=...&limit=50)
  constructor(query, navigate) {
    this.navigate = navigate;
    this.states = new Set(query.getAll("state").filter((s) => STATES.includes(s)));
    this.name = searchable(query.get("name") || "") ? query.get("name") : "";
    this.limit = PAGE_SIZES.includes(Number(query.get("limit"))) ? Number(query.get("limit")) : 50;
    this.cursor = query.get("cursor") || null;
    this.previous = []; // cursors of the pages before this one, for "Newer"
    this.rows = new Map(); // job id -> {tr, stamp}
    this.page = null;
  }

  mount(root) {
    this.tbody = el("tbody");
    this.empty = el("div", { class: "empty-state", hidden: true });
    this.pager = el("div", { class: "pager" });
    root.replaceChildren(
      el("section", { class: "toolbar" }, this.filterChips(), this.searchBox()),
      el("div", { class: "card table-card" },
        el("table", { class: "jobs" },
          el("thead", {}, el("tr", {},
            ["ID", "Name", "State", "Progress", "Nodes × tasks", "Attempt", "Owner", "Backend", "Submitted", "Duration"]
              .map((h) => el("th", { scope: "col" }, h)))),
          this.tbody),
        this.empty),
      this.pager,
    );
    document.title = "Jobs · torchyard";
  }

  // ---------------------------------------------------------------- toolbar

  filterChips() {
    const chip = (label, states, title) => {
      const on = states.length === this.states.size && states.every((s) => this.states.has(s));
      return el("button", {
        type: "button", class: `chip${on ? " on" : ""}${states.length === 1 ? ` state-${states[0]}` : ""}`,
        "aria-pressed": String(on), title, dataset: { filter: label },
        onclick: () => this.setStates(on ? [] : states),
      }, label);
    };
    return el("div", { class: "chips", role: "group", "aria-label": "filter by state" },
      chip("all", [], "every job"),
      chip("active", ACTIVE, "not finished yet"),
      ...STATES.filter((s) => !["submitted", "requeued"].includes(s)).map((s) => chip(s, [s], `only ${s}`)));
  }

  searchBox() {
    let timer = null;
    const input = el("input", {
      type: "search", placeholder: "Filter by name…", value: this.name, "aria-label": "filter by name",
      class: "search", name: "name",
      oninput: () => {
        clearTimeout(timer);
        const name = input.value.trim();
        const tooShort = name !== "" && !searchable(name);
        hint.hidden = !tooShort;
        if (tooShort) return; // the list stays as it is until the name is long enough to look for
        timer = setTimeout(() => {
          this.name = name;
          this.goTo(null);
        }, 250);
      },
    });
    const hint = el("span", { class: "search-hint", hidden: true, role: "status" }, `Type ${MIN_NAME} or more characters`);
    const size = el("select", {
      "aria-label": "jobs per page", class: "page-size",
      onchange: () => { this.limit = Number(size.value); this.goTo(null); },
    }, PAGE_SIZES.map((n) => el("option", { value: n, selected: n === this.limit }, `${n} / page`)));
    return el("div", { class: "search-wrap" }, input, hint, size);
  }

  setStates(states) {
    this.states = new Set(states);
    this.goTo(null);
  }

  // Filters and page live in the hash: reload and back keep them.
  goTo(cursor, previous = []) {
    this.cursor = cursor;
    this.previous = previous;
    const query = this.query(false);
    this.navigate(`#/${query ? `?${query}` : ""}`, { previous });
  }

  query(forApi = true) {
    const q = new URLSearchParams();
    for (const s of [...this.states].sort()) q.append("state", s);
    if (this.name) q.set("name", this.name);
    if (this.cursor) q.set("cursor", this.cursor);
    if (forApi || this.limit !== 50) q.set("limit", String(this.limit));
    return q.toString();
  }

  // ---------------------------------------------------------------- polling

  async refresh() {
    const { data, changed } = await api.listJobs(this.query());
    if (changed || !this.page) {
      this.page = data;
      this.renderRows(data.items);
      this.renderPager(data);
    }
    this.tickTimes();
  }

  renderRows(jobs) {
    const seen = new Map();
    const trs = jobs.map((job) => {
      const kept = this.rows.get(job.id);
      const row = kept && kept.stamp === job.updated_at ? kept : { tr: this.row(job), stamp: job.updated_at, job };
      seen.set(job.id, row);
      return row.tr;
    });
    const same = trs.length === this.tbody.children.length && trs.every((tr, i) => this.tbody.children[i] === tr);
    if (!same) this.tbody.replaceChildren(...trs); // only when rows changed: keeps text selections alive
    this.rows = seen;
    this.renderEmpty(jobs.length === 0);
  }

  row(job) {
    const showReason = job.reason && !QUIET_REASONS.has(job.state);
    const open = () => { location.hash = `#/jobs/${job.id}`; };
    return el("tr", { class: `job-row state-${job.state}`, dataset: { jobId: job.id, state: job.state }, onclick: open },
      el("td", { class: "num id" }, `#${job.id}`),
      el("td", { class: "name" }, el("a", { href: `#/jobs/${job.id}`, onclick: (e) => e.stopPropagation() }, job.name)),
      el("td", { class: "state" }, badge(job.state),
        showReason ? el("div", { class: `reason reason-${job.state}`, title: job.reason }, startEstimate(job) || summary(job.reason)) : null),
      el("td", { class: "progress-cell" }, progressBar(job)),
      el("td", { class: "num" }, resources(job)),
      el("td", { class: "num" }, job.attempt),
      el("td", {}, job.owner),
      el("td", {}, el("span", { class: "backend" }, job.backend)),
      el("td", { class: "age", title: localTime(job.created_at), dataset: { created: job.created_at } }, ago(job.created_at)),
      el("td", { class: "num dur" }, duration(runTime(job))),
    );
  }

  // Ages and running durations move on between polls even when the server answers 304.
  tickTimes() {
    for (const { tr, job } of this.rows.values()) {
      tr.querySelector(".age").textContent = ago(job.created_at);
      if (!TERMINAL.has(job.state)) tr.querySelector(".dur").textContent = duration(runTime(job));
    }
  }

  renderEmpty(isEmpty) {
    this.empty.hidden = !isEmpty;
    if (!isEmpty) return;
    const filtered = this.states.size || this.name || this.cursor;
    this.empty.replaceChildren(...(filtered
      ? [el("h2", {}, "No jobs match these filters"),
        el("p", {}, "Try another state or name, or ",
          el("button", { type: "button", class: "link", onclick: () => { this.states.clear(); this.name = ""; this.goTo(null); } },
            "show every job"), ".")]
      : [el("h2", {}, "No jobs yet"),
        el("p", {}, "Jobs you submit show up here within a couple of seconds."),
        el("pre", { class: "hint" }, "torchyard submit job.yaml --wait\n# or: POST /api/v1/jobs  (see the API docs)"),
        el("p", {}, el("a", { href: "/docs" }, "Open the API docs →"))]));
  }

  renderPager(page) {
    const first = !this.cursor;
    const newer = el("button", {
      type: "button", class: "button", disabled: first,
      onclick: () => {
        const previous = [...this.previous];
        const cursor = previous.pop() ?? null;
        this.goTo(cursor, previous);
      },
    }, "← Newer");
    const older = el("button", {
      type: "button", class: "button", disabled: !page.next_cursor, dataset: { action: "older" },
      onclick: () => this.goTo(page.next_cursor, [...this.previous, this.cursor]),
    }, "Older →");
    const where = first ? "Newest jobs" : this.previous.length ? `Page ${this.previous.length + 1}` : "Older jobs";
    const count = el("span", { class: "where" }, `${where} · ${page.items.length} shown`);
    if (first && !page.next_cursor) {
      this.pager.replaceChildren(count); // everything fits on one page: no buttons to grey out
      return;
    }
    this.pager.replaceChildren(
      el("button", { type: "button", class: "button ghost", disabled: first, onclick: () => this.goTo(null) }, "⇤ Newest"),
      newer, count, older);
  }
}

// One line for the table: a traceback's head ("rank 1 raised:") and its last line (the exception).
export function summary(text) {
  const lines = String(text).split("\n").map((l) => l.trim()).filter(Boolean);
  let line = lines[0] || "";
  if (lines.length > 1 && line.endsWith(":")) {
    const exception = lines.filter((l) => EXCEPTION_LINE.test(l)).pop() || lines[lines.length - 1];
    line = `${line} ${exception}`;
  }
  return line.length > 120 ? `${line.slice(0, 118)}…` : line;
}
