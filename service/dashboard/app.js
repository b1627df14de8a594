// The dashboard's shell: hash routing (#/ and #/jobs/12), one poll loop, the status light, errors.

import { ApiError } from "./api.js";
import { JobView } from "./job_view.js";
import { JobsView } from "./jobs_view.js";
import { el } from "./format.js";

const POLL_MS = 2000;

const root = document.getElementById("view");
const banner = document.getElementById("banner");
const status = document.getElementById("status");

let view = null;
let timer = null;
let generation = 0; // bumps on every navigation: a late answer for the old view is dropped
let carried = {}; // state a view hands to the next one (the list's "Newer" stack)

function navigate(hash, state = {}) {
  carried = state;
  if (location.hash === hash) route();
  else location.hash = hash;
}

function route() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, search = ""] = hash.split("?");
  const query = new URLSearchParams(search);
  view?.unmount?.();
  const match = path.match(/^\/jobs\/(\d+)$/);
  if (match) {
    view = new JobView(Number(match[1]), showError);
  } else {
    view = new JobsView(query, navigate);
    view.previous = carried.previous || [];
  }
  carried = {};
  generation += 1;
  view.mount(root);
  poll();
}

async function poll() {
  clearTimeout(timer);
  const mine = generation;
  const current = view;
  try {
    await current.refresh();
    if (mine !== generation) return;
    clearError();
    setStatus("live", `updated ${new Date().toLocaleTimeString()}`);
  } catch (error) {
    if (mine !== generation) return;
    showError(error);
  }
  if (mine === generation && !document.hidden) timer = setTimeout(poll, POLL_MS);
}

function showError(error) {
  const message = error instanceof ApiError || error instanceof Error ? error.message : String(error);
  const notFound = error instanceof ApiError && error.status === 404 && view instanceof JobView;
  if (notFound) {
    root.replaceChildren(el("div", { class: "empty-state" }, el("h2", {}, `Job ${view.id} not found`),
      el("p", {}, el("a", { href: "#/" }, "← Back to all jobs"))));
  }
  banner.replaceChildren(el("strong", {}, error.status === 0 ? "Offline. " : "Error. "), message,
    el("span", { class: "muted" }, notFound ? "" : ` — retrying every ${POLL_MS / 1000} s`));
  banner.hidden = false;
  setStatus("error", error.status === 0 ? "service unreachable" : "error");
  console.error(error);
}

function clearError() {
  banner.hidden = true;
}

function setStatus(kind, text) {
  status.dataset.kind = kind;
  status.querySelector(".text").textContent = text;
}

// A hidden tab stops polling (no load on the service); it catches up the moment it is shown again.
document.addEventListener("visibilitychange", () => {
  if (!document.hidden) poll();
});
window.addEventListener("hashchange", route);
window.addEventListener("unhandledrejection", (event) => showError(event.reason));
route();
