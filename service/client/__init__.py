"""A small typed client for the torchyard REST API, for the CLI and for users' own scripts.

    from service.client import TorchyardClient

    with TorchyardClient() as client:            # TORCHYARD_URL, else http://127.0.0.1:8321
        job = client.submit({"name": "hello", "entrypoint": "worker.tasks.train:train"})
        final = client.wait(job["id"])
        print(final["state"], final["result"])

Kept free of FastAPI, SQLModel and torch so that importing it is cheap: jobs travel as plain dicts
(the JSON the API returns); a JobCreate, or any pydantic model, is accepted wherever a spec is.
A request that may safely be made twice is made again when its connection fails (service.client.wire).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from service.client.logins import Logins
from service.client.notifications import Notifications
from service.client.pipelines import Pipeline, Pipelines
from service.client.wire import (
    DEFAULT_URL,
    LONG_POLL_S,
    TERMINAL_STATES,
    Spec,
    TorchyardError,
    WaitTimeout,
    _as_object,
    _body,
    discover_token,
    discover_url,
    error_message,
    save_token,
    send,
    spec_body,
    token_path,
)
from service.code_pack import pack

__all__ = [
    "DEFAULT_URL",
    "TERMINAL_STATES",
    "Job",
    "Pipeline",
    "Sweep",
    "TorchyardClient",
    "TorchyardError",
    "WaitTimeout",
    "discover_token",
    "discover_url",
    "error_message",
    "save_token",
    "token_path",
]

Job = dict[str, Any]
Jobs = list[Job]  # module-level alias: inside the class, `list` names the method
Sweep = dict[str, Any]


UPLOAD_CHUNK = 256 * 1024


def _chunks(data: bytes, progress: Callable[[int, int], None] | None) -> Iterator[bytes]:
    for start in range(0, len(data), UPLOAD_CHUNK):
        yield data[start : start + UPLOAD_CHUNK]
        if progress is not None:
            progress(min(start + UPLOAD_CHUNK, len(data)), len(data))


class TorchyardClient(Notifications, Pipelines, Logins):
    """One connection pool to one service. Methods return the API's JSON; errors raise TorchyardError."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = (base_url or discover_url()).rstrip("/")
        # token="" means "send none" even when the environment has one.
        self.token = discover_token() if token is None else (token or None)
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._http = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )
        # A long poll must end well before the client gives up on the answer.
        self._long_poll_s = max(0.0, min(LONG_POLL_S, timeout - 5.0))
        self._etags: dict[str, tuple[str, Job]] = {}  # path -> (ETag, body) of the last 200

    # ---------------------------------------------------------------- lifecycle

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> TorchyardClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---------------------------------------------------------------- jobs

    def submit(self, spec: Spec, idempotency_key: str | None = None) -> Job:
        """POST /api/v1/jobs; returns the new job (state "queued")."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._object("POST", "/api/v1/jobs", json=spec_body(spec), headers=headers)

    def list(
        self,
        state: str | Iterable[str] | None = None,
        name: str | None = None,
        limit: int = 50,
        cursor: str | None = None,
        since: datetime | str | None = None,
    ) -> dict[str, Any]:
        """One page, newest first: {"items": [...], "next_cursor": str | None}."""
        params: dict[str, Any] = {"limit": limit}
        if state is not None:
            params["state"] = [state] if isinstance(state, str) else [str(s) for s in state]
        if name:
            params["name"] = name
        if cursor:
            params["cursor"] = cursor
        if since is not None:
            params["since"] = since.isoformat() if isinstance(since, datetime) else since
        return self._object("GET", "/api/v1/jobs", params=params)

    def iter_jobs(
        self, state: str | Iterable[str] | None = None, name: str | None = None, page_size: int = 100
    ) -> Iterator[Job]:
        """Every matching job, newest first, following next_cursor page by page."""
        states = None if state is None else ([state] if isinstance(state, str) else [*state])
        cursor: str | None = None
        while True:
            page = self.list(state=states, name=name, limit=page_size, cursor=cursor)
            yield from page["items"]
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def get(self, job_id: int, wait_s: float = 0) -> Job:
        """One job. Asks with the last ETag seen for it, so an unchanged job costs the service a 304.

        With wait_s > 0 (and an ETag seen before) it is a long poll: the service answers as soon as
        the job changes, or after wait_s with the job as it was. When the service holds as many long
        polls as it allows (429), it is a plain read instead: wait() paces the rounds then.
        """
        path = f"/api/v1/jobs/{job_id}"
        cached = self._etags.get(path)
        headers = {"If-None-Match": cached[0]} if cached else None
        params = {"wait_s": round(wait_s, 3)} if cached and wait_s > 0 else None
        try:
            response = self._request("GET", path, headers=headers, params=params)
        except TorchyardError as error:
            if error.status != 429 or params is None:
                raise
            response = self._request("GET", path, headers=headers)
        if response.status_code == 304 and cached:
            return dict(cached[1])  # a copy: callers may change what they get
        job = _as_object(response)
        etag = response.headers.get("etag")
        if etag:
            self._etags[path] = (etag, dict(job))
        return job

    def events(self, job_id: int) -> Jobs:
        """The job's state history, oldest first."""
        return self._array("GET", f"/api/v1/jobs/{job_id}/events")

    def attempts(self, job_id: int) -> Jobs:
        """Its attempts, the first first: how each ended, its backend id, where it ran."""
        return self._array("GET", f"/api/v1/jobs/{job_id}/attempts")

    def metrics(self, job_id: int, name: str | None = None, after_step: int | None = None) -> Jobs:
        params: dict[str, Any] = {}
        if name:
            params["name"] = name
        if after_step is not None:
            params["after_step"] = after_step
        return self._array("GET", f"/api/v1/jobs/{job_id}/metrics", params=params)

    def metric_series(
        self, job_id: int, points: int, from_step: int | None = None, to_step: int | None = None
    ) -> dict[str, Any]:
        """Each series (metric and attempt) in at most `points` points, spikes kept: a long run's shape
        at the cost of a short one's. `from_step`/`to_step` zoom in."""
        params: dict[str, Any] = {"points": points}
        if from_step is not None:
            params["from_step"] = from_step
        if to_step is not None:
            params["to_step"] = to_step
        return self._object("GET", f"/api/v1/jobs/{job_id}/metrics", params=params)

    def logs(self, job_id: int, rank: int = 0, tail: int | None = None, stream: str = "out") -> str:
        """One rank's log as text ("out" is stdout, "err" is stderr)."""
        params: dict[str, Any] = {"rank": rank, "stream": stream}
        if tail is not None:
            params["tail"] = tail
        return self._request("GET", f"/api/v1/jobs/{job_id}/logs", params=params).text

    def stacks(self, job_id: int, capture: bool | None = None) -> dict[str, Any]:
        """Every rank's stacks: captured now from a running job (a few seconds), or the last capture
        kept (`capture=False`, and any job that is not running)."""
        params = {} if capture is None else {"capture": "true" if capture else "false"}
        return self._object("GET", f"/api/v1/jobs/{job_id}/stacks", params=params)

    def cancel(self, job_id: int) -> Job:
        """Idempotent: cancelling a finished job returns it unchanged."""
        return self._object("POST", f"/api/v1/jobs/{job_id}/cancel")

    def wait(
        self,
        job_id: int,
        on_update: Callable[[Job], object] | None = None,
        poll_s: float = 0.5,
        timeout_s: float | None = None,
    ) -> Job:
        """Until the job is terminal; returns it. on_update sees the job after every answer.

        Each round is a long poll, so the service answers when the job changes and the caller hears
        of the end at once; poll_s only paces rounds that come back early with nothing new.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        last: Job | None = None
        while True:
            asked = time.monotonic()
            wait_s = self._long_poll_s if deadline is None else min(self._long_poll_s, deadline - asked)
            job = self.get(job_id, wait_s=max(0.0, wait_s))
            if on_update is not None:
                on_update(job)
            if job["state"] in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"job {job_id} is still {job['state']} after {timeout_s} s")
            if job == last:  # nothing new and back early: a service that does not hold the answer
                time.sleep(max(0.0, poll_s - (time.monotonic() - asked)))
            last = job

    # ---------------------------------------------------------------- sweeps

    def submit_sweep(self, sweep: Spec, idempotency_key: str | None = None) -> Sweep:
        """POST /api/v1/sweeps: {"name", "job", "grid", "zip", "max_parallel", "metric", "goal"};
        returns the sweep with its trials (each a queued job)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._object("POST", "/api/v1/sweeps", json=spec_body(sweep), headers=headers)

    def sweeps(self, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        """One page of sweeps, newest first: {"items": [...], "next_cursor": ...}."""
        params: dict[str, Any] = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        return self._object("GET", "/api/v1/sweeps", params=params)

    def sweep(self, sweep_id: int) -> Sweep:
        """The sweep: its trials with their metric, state counts and the best trial."""
        return self._object("GET", f"/api/v1/sweeps/{sweep_id}")

    def resume_trial(self, sweep_id: int, number: int) -> Sweep:
        """Continue trial `number`, which early_stop stopped, to the end from its latest checkpoint."""
        return self._object("POST", f"/api/v1/sweeps/{sweep_id}/trials/{number}/resume")

    def cancel_sweep(self, sweep_id: int) -> Sweep:
        """Cancel every unfinished trial; idempotent."""
        return self._object("POST", f"/api/v1/sweeps/{sweep_id}/cancel")

    def wait_sweep(
        self,
        sweep_id: int,
        on_update: Callable[[Sweep], object] | None = None,
        poll_s: float = 2.0,
        timeout_s: float | None = None,
    ) -> Sweep:
        """Until every trial has ended; returns the sweep. on_update sees it after every read."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            sweep = self.sweep(sweep_id)
            if on_update is not None:
                on_update(sweep)
            if sweep["state"] == "finished":
                return sweep
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"sweep {sweep_id} still has unfinished trials after {timeout_s} s")
            time.sleep(poll_s)

    # ---------------------------------------------------------------- access

    def whoami(self) -> dict[str, Any]:
        """{"user": ..., "admin": ...}: who this client's token says it is."""
        return self._object("GET", "/api/v1/whoami")

    def audit(self, actor: str | None = None, limit: int = 100, before_id: int | None = None) -> Jobs:
        """The audit log, newest first (admin tokens only)."""
        params: dict[str, Any] = {"limit": limit}
        if actor is not None:
            params["actor"] = actor
        if before_id is not None:
            params["before_id"] = before_id
        return self._array("GET", "/api/v1/audit", params=params)

    def health(self) -> dict[str, Any]:
        """GET /healthz. A degraded service (503) still answers with its body, so no error here."""
        response = self._send("GET", "/healthz")
        if response.status_code not in (200, 503):
            message, detail = error_message(response)
            raise TorchyardError(message, response.status_code, detail)
        return _as_object(response)

    # ---------------------------------------------------------------- code snapshots

    def upload_code(self, path: str | Path, progress: Callable[[int, int], None] | None = None) -> str:
        """Pack the project folder `path` (service.code_pack) and upload it unless the service has it
        already; its id, `sha256:<hex>`, for a spec's `code`. `progress(sent, total)` follows a
        large upload."""
        packed = pack(Path(path))
        try:
            self._object("GET", f"/api/v1/code/{packed.id}")
            return packed.id  # this user uploaded the same files before
        except TorchyardError as error:
            if error.status != 404:
                raise
        body = _chunks(packed.data, progress)
        headers = {"Content-Type": "application/gzip", "Content-Length": str(len(packed.data))}
        answer = self._object("POST", "/api/v1/code", content=body, headers=headers)
        if answer.get("id") != packed.id:
            raise TorchyardError(f"the service stored the code as {answer.get('id')}, not {packed.id}")
        return packed.id

    def code(self, code_id: str) -> dict[str, Any]:
        """GET /api/v1/code/{id}: one of your snapshots, with its file list."""
        return self._object("GET", f"/api/v1/code/{code_id}")

    # ---------------------------------------------------------------- plumbing

    def _object(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        return _as_object(self._request(method, path, **kwargs))

    def _array(self, method: str, path: str, **kwargs: Any) -> Jobs:
        body = _body(self._request(method, path, **kwargs))
        if not isinstance(body, list):
            raise TorchyardError(f"expected a JSON list from {path}, got {type(body).__name__}")
        return body

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = self._send(method, path, **kwargs)
        if response.is_error:
            message, detail = error_message(response)
            raise TorchyardError(message, response.status_code, detail)
        return response

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """The service's answer, whatever its status; TorchyardError when none came."""
        try:
            return send(self._http, method, path, **kwargs)
        except httpx.HTTPError as error:
            raise self._unreachable(error) from error

    def _unreachable(self, error: httpx.HTTPError) -> TorchyardError:
        kind = type(error).__name__
        return TorchyardError(f"cannot reach torchyard at {self.base_url} ({kind}: {error})")
