// Every request the dashboard makes goes through request(): one place for headers, errors and ETags.

const API = "/api/v1";

export class ApiError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

// The server's clock minus ours (ms), from the Date header: ages and durations shown in the page do
// not depend on the browser's clock being right.
let clockSkewMs = 0;
export function serverNow() {
  return Date.now() + clockSkewMs;
}

function noteServerDate(response) {
  const date = Date.parse(response.headers.get("Date") || "");
  if (!Number.isNaN(date)) clockSkewMs = Math.round(0.8 * clockSkewMs + 0.2 * (date - Date.now()));
}

// The API token lives in sessionStorage: it survives a reload of this tab but not closing it, and no
// other tab or later visitor of this browser profile finds it on disk.
const TOKEN_KEY = "torchyard.token";
localStorage.removeItem(TOKEN_KEY); // an older dashboard kept it there: do not leave it lying around

export const session = {
  token: () => sessionStorage.getItem(TOKEN_KEY),
  save(token) {
    sessionStorage.setItem(TOKEN_KEY, token);
    cache.clear(); // answers remembered for one user must never be replayed for another
  },
  clear() {
    sessionStorage.removeItem(TOKEN_KEY);
    cache.clear();
  },
};

// `token` overrides the stored one: the sign-in form tries a token before keeping it.
function headers(extra, token) {
  const out = { Accept: "application/json", ...extra };
  const bearer = token === undefined ? session.token() : token;
  if (bearer) out.Authorization = `Bearer ${bearer}`;
  return out;
}

async function errorText(response) {
  const fallback = `${response.status} ${response.statusText || "error"}`;
  try {
    const body = await response.json();
    if (Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ") || fallback;
    if (typeof body.detail === "string") return body.detail;
  } catch {
    // not JSON: the status line says enough
  }
  return fallback;
}

// Last answer per URL, revalidated with If-None-Match: a 304 hands back the body we already have.
const cache = new Map();
const CACHE_SIZE = 200; // URLs; pages of a long browse are dropped oldest first

function remember(url, etag, data) {
  cache.delete(url); // re-inserted at the end: Map keeps insertion order
  cache.set(url, { etag, data });
  if (cache.size > CACHE_SIZE) cache.delete(cache.keys().next().value);
}

// GET/POST `path` under /api/v1. Returns {data, changed}: changed is false when the server said 304.
export async function request(path, { method = "GET", body, text = false, token } = {}) {
  const url = API + path;
  const cached = method === "GET" && token === undefined ? cache.get(url) : undefined;
  const extra = cached ? { "If-None-Match": cached.etag } : {};
  if (body !== undefined) extra["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(url, {
      method,
      headers: headers(extra, token),
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store", // we revalidate ourselves, so a 304 reaches this code instead of the cache
    });
  } catch (error) {
    throw new ApiError(`cannot reach the torchyard service (${error.message})`, 0);
  }
  noteServerDate(response);
  if (response.status === 304 && cached) return { data: cached.data, changed: false };
  if (!response.ok) throw new ApiError(await errorText(response), response.status);
  const data = text ? await response.text() : await response.json();
  const etag = response.headers.get("ETag");
  if (method === "GET" && etag && token === undefined) remember(url, etag, data);
  return { data, changed: true };
}

export const api = {
  whoami: (token) => request("/whoami", { token }),
  // No token needed for these two: how this service signs in, and the LDAP sign-in itself.
  signInMethods: () => request("/auth/service", { token: null }),
  ldapSignIn: (user, password) => request("/auth/ldap", { method: "POST", body: { user, password }, token: null }),
  listJobs: (query) => request(`/jobs?${query}`),
  job: (id) => request(`/jobs/${id}`),
  events: (id) => request(`/jobs/${id}/events`),
  attempts: (id) => request(`/jobs/${id}/attempts`),
  metricSeries: (id, points, zoom) =>
    request(`/jobs/${id}/metrics?points=${points}${zoom ? `&from_step=${zoom.from}&to_step=${zoom.to}` : ""}`),
  logs: (id, rank, stream, tail) =>
    request(`/jobs/${id}/logs?rank=${rank}&stream=${stream}${tail ? `&tail=${tail}` : ""}`, { text: true }),
  cancel: (id) => request(`/jobs/${id}/cancel`, { method: "POST" }),
  stacks: (id, capture) => request(`/jobs/${id}/stacks?capture=${capture ? "true" : "false"}`),
  trialMetric: (id, name, afterStep) =>
    request(`/jobs/${id}/metrics?name=${encodeURIComponent(name)}${afterStep == null ? "" : `&after_step=${afterStep}`}`),
  sweeps: () => request("/sweeps?limit=100"),
  sweep: (id) => request(`/sweeps/${id}`),
  pipelines: () => request("/pipelines?limit=100"),
  pipeline: (id) => request(`/pipelines/${id}`),
  code: (codeId) => request(`/code/${codeId}`),
};
