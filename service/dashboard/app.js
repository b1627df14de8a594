// The dashboard's shell: who is signed in, hash routing (#/, #/jobs/12, #/sweeps, #/sweeps/3,
// #/pipelines, #/pipelines/4), one poll loop, the status light, errors.

import { ApiError, api, session } from "./api.js";
import { JobView } from "./job_view.js";
import { JobsView } from "./jobs_view.js";
import { PipelineView, PipelinesView } from "./pipeline_view.js";
import { SignInView } from "./sign_in.js";
import { SweepView, SweepsView } from "./sweeps_view.js";
import { el } from "./format.js";

const POLL_MS = 2000;

const root = document.getElementById("view");
const banner = document.getElementById("banner");
const status = document.getElementById("status");
const who = document.getElementById("who");

let user = null; // {user, admin} from /whoami; null while signed out: nothing is fetched then
let view = null;
let timer = null;
let generation = 0; // bumps on every navigation: a late answer for the old view is dropped
let carried = {}; // state a view hands to the next one (the list's "Newer" stack)

// ---------------------------------------------------------------- signing in and out

// Who are we? A token in this tab, or none at all in dev mode, where the service needs none.
async function start() {
  clearTimeout(timer);
  try {
    const { data } = await api.whoami();
    signedIn(data);
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      // No token yet is the normal first visit; a stored token that stopped working deserves a word.
      signOut(session.token() ? `Signed out: ${error.message}` : "");
      return;
    }
    showError(error);
    timer = setTimeout(start, POLL_MS); // service down: keep trying, as the poll loop would
  }
}

function signedIn(me) {
  user = me;
  who.querySelector(".user").textContent = me.user;
  who.querySelector(".role").hidden = !me.admin;
  who.querySelector(".sign-out").hidden = !session.token(); // dev mode: no token, nothing to sign out of
  who.hidden = false;
  route();
}

function signOut(notice = "") {
  session.clear();
  user = null;
  generation += 1; // answers still in flight for the old view are dropped
  clearTimeout(timer);
  view?.unmount?.();
  view = new SignInView(signedIn, notice);
  view.mount(root);
  who.hidden = true;
  clearError();
  setStatus("signed-out", "signed out");
}

// ---------------------------------------------------------------- routing and polling

function navigate(hash, state = {}) {
  carried = state;
  if (location.hash === hash) route();
  else location.hash = hash;
}

function route() {
  if (!user) return; // the sign-in form stays; after sign-in we land on the hash asked for
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, search = ""] = hash.split("?");
  const query = new URLSearchParams(search);
  view?.unmount?.();
  const match = path.match(/^\/jobs\/(\d+)$/);
  const sweep = path.match(/^\/sweeps\/(\d+)$/);
  const pipeline = path.match(/^\/pipelines\/(\d+)$/);
  if (match) {
    view = new JobView(Number(match[1]), showError);
  } else if (sweep) {
    view = new SweepView(Number(sweep[1]));
  } else if (path === "/sweeps") {
    view = new SweepsView();
  } else if (pipeline) {
    view = new PipelineView(Number(pipeline[1]));
  } else if (path === "/pipelines") {
    view = new PipelinesView();
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
  if (!user) return;
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

// A page for one thing whose thing is gone: what to call it, and where to go back to.
const NOT_FOUND = [
  [JobView, "Job", "#/", "all jobs"],
  [SweepView, "Sweep", "#/sweeps", "all sweeps"],
  [PipelineView, "Pipeline", "#/pipelines", "all pipelines"],
];

function showError(error) {
  if (error instanceof ApiError && error.status === 401) {
    // Revoked, or the service forgot it: show no more data, ask again. A late answer for a view that
    // is already gone (user is null) must not put a message on a form that was left cleanly.
    if (user) signOut(`Signed out: ${error.message}`);
    return;
  }
  const message = error instanceof ApiError || error instanceof Error ? error.message : String(error);
  const what = NOT_FOUND.find(([kind]) => view instanceof kind)?.slice(1);
  const notFound = error instanceof ApiError && error.status === 404 && what;
  if (notFound) {
    root.replaceChildren(el("div", { class: "empty-state" }, el("h2", {}, `${what[0]} ${view.id} not found`),
      el("p", {}, el("a", { href: what[1] }, `← Back to ${what[2]}`))));
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
who.querySelector(".sign-out").addEventListener("click", () => signOut());
start();
