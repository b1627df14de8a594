"""The client's side of the wire: where the service and the token are found, the service's errors as
exceptions, and the requests made again when their connection fails.

A kept-alive connection can be closed by the service just as the client reuses it (the request then
meets a reset, or an end before any answer), and a service restarting refuses connections for a
moment: the request got no answer, and the service may or may not have acted on it. One that may
safely be made twice is made again, a few times, a little later each time (`send`): the idempotent
methods, and a POST with an Idempotency-Key (the service answers its second with what the first
made). A POST without one is never made twice: it could make two jobs.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import httpx

from service.states import TERMINAL_STATE_NAMES

log = logging.getLogger(__name__)

DEFAULT_URL = "http://127.0.0.1:8321"
URL_ENV = "TORCHYARD_URL"
TOKEN_ENV = "TORCHYARD_TOKEN"
# Kept under the name users' scripts import it by; the list itself lives in service.states.
TERMINAL_STATES = TERMINAL_STATE_NAMES
LONG_POLL_S = 20.0  # per round of wait(): the service holds at most 30 s


class TorchyardError(Exception):
    """The service said no (status is the HTTP code) or could not be reached (status is None)."""

    def __init__(self, message: str, status: int | None = None, detail: Any = None) -> None:
        super().__init__(message if status is None else f"{status}: {message}")
        self.message = message
        self.status = status
        self.detail = detail  # the body's "detail" as the server sent it, for callers that want fields


class WaitTimeout(TorchyardError):
    """wait() gave up before the job reached a terminal state; the job itself goes on."""


def token_path() -> Path:
    """Where the CLI and client look for a saved token: $XDG_CONFIG_HOME/torchyard/token."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "torchyard" / "token"


def save_token(raw: str) -> Path:
    """Write `raw` to the token file, readable by its owner alone: a new file (0600 before a byte is
    written) renamed over the old name, so a link there is replaced, never followed, and a reader sees
    the old token or the new one whole. Returns the path."""
    path = token_path()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".token-")  # 0600, made anew
    try:
        with os.fdopen(fd, "w") as file:
            file.write(raw + "\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def discover_token() -> str | None:
    """The token from TORCHYARD_TOKEN, else from the token file; None when neither has one."""
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    try:
        token = token_path().read_text().strip()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    return token or None


def discover_url() -> str:
    return os.environ.get(URL_ENV, "").strip() or DEFAULT_URL


def error_message(response: httpx.Response) -> tuple[str, Any]:
    """The server's own words: FastAPI's {"detail": [{"loc", "msg"}, ...]} flattened to one line."""
    try:
        body = response.json()
    except ValueError:
        return (response.text.strip() or response.reason_phrase or "no message"), None
    detail = body.get("detail") if isinstance(body, dict) else None
    if isinstance(detail, str):
        return detail, detail
    if isinstance(detail, list) and detail:
        return "; ".join(_one_problem(item) for item in detail), detail
    return str(body)[:500], detail


def _one_problem(item: Any) -> str:
    if not isinstance(item, dict):
        return str(item)
    msg = str(item.get("msg", "invalid"))
    # "body" and "query" say where the field was, not which field: users wrote `resources.nodes`.
    loc = [str(part) for part in item.get("loc", []) if part not in ("body", "query", "path")]
    field = ".".join(loc)
    if not field or msg.startswith(field):  # the service's own errors already name the field
        return msg
    return f"{field}: {msg}"


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError as error:  # a proxy's HTML page, say: not the service
        raise TorchyardError(f"expected JSON from {response.url}, got: {response.text[:200]!r}") from error


def _as_object(response: httpx.Response) -> dict[str, Any]:
    body = _body(response)
    if not isinstance(body, dict):
        raise TorchyardError(f"expected a JSON object from {response.url}, got {type(body).__name__}")
    return body


RETRY_WAITS_S = (0.1, 0.3, 1.0)  # before each try after the first
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
# No answer came: refused, reset, or closed before a byte of one. Not a timeout: a request that took
# too long would take too long again, and the caller set how long it may wait.
CONNECTION_FAILURES = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)


def retryable(method: str, headers: Mapping[str, str] | None) -> bool:
    """May this request be made again when its connection fails?"""
    if method.upper() in IDEMPOTENT_METHODS:
        return True
    return method.upper() == "POST" and any(name.lower() == "idempotency-key" for name in headers or {})


def send(http: httpx.Client, method: str, path: str, **kwargs: Any) -> httpx.Response:
    """`http.request(method, path, **kwargs)`, made again after each of RETRY_WAITS_S while its
    connection fails, if it is `retryable`; the last error is raised (an httpx.HTTPError)."""
    waits = list(RETRY_WAITS_S) if retryable(method, kwargs.get("headers")) else []
    while True:
        try:
            return http.request(method, path, **kwargs)
        except CONNECTION_FAILURES as error:
            if not waits:
                raise
            log.debug("%s %s: %s; trying again", method, path, type(error).__name__)
            time.sleep(waits.pop(0))


class _Dumpable(Protocol):
    def model_dump(self, *, mode: str = ..., exclude_unset: bool = ...) -> dict[str, Any]: ...


Spec = Mapping[str, Any] | _Dumpable  # a job, sweep or pipeline: JSON-like, or its pydantic model


def spec_body(spec: Spec) -> dict[str, Any]:
    """The body a spec is POSTed as."""
    if isinstance(spec, Mapping):
        return dict(spec)
    # Only what the caller set: the server fills in its own defaults (backend, resources).
    return spec.model_dump(mode="json", exclude_unset=True)
