"""The request gate: what every request passes before a route sees it, none of it reading the body.

1. A body declared larger than `max_body_bytes` gets 413 unread; one that grows past it while a route
   reads it gets 413 too (chunked bodies declare no length).
2. Dev mode (no tokens, every caller is admin): the peer must be this machine; so must the name it
   asked for (Host), or a page on any DNS name that resolves to 127.0.0.1 could drive the API
   (DNS rebinding); a browser's Origin, when sent, must be the service itself, and a write may not
   carry a form or text/plain body, the kinds a cross-site page can send without asking (CSRF).
3. The token, on every path but the public ones: 401 before one byte of the body is read, so a
   stranger's 10 MB body costs nothing but its transfer. A token not checked lately is looked up
   once however many of its requests arrive meanwhile (a dashboard's 50 polls wait for that one
   lookup): when the check cached for 2 s ran out, each of the polls in flight looked it up in a
   thread of its own, 50 threads fighting the event loop for the GIL every 2 s, which set the
   pollers' tail latency (bench.poll).
The caller it finds is left in the scope for the routes (service.api.deps.get_current_user).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import MutableMapping
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy.exc import OperationalError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.errors import database_down_response, service_error_response
from service.api.loopback import is_loopback
from service.api.routes.dashboard import ASSETS_PREFIX
from service.config import Settings
from service.domain.auth import DEV_PRINCIPAL, Principal, TokenCheck, bearer_token
from service.errors import Forbidden, ServiceError, TooLarge, Unauthenticated

PRINCIPAL = "torchyard.principal"  # the scope key the gate leaves the caller under
# A login is how a caller without a token gets one (service.api.routes.logins).
PUBLIC_PATHS = frozenset(
    {
        "/",
        "/healthz",
        "/docs",
        "/openapi.json",
        "/api/v1/auth/service",
        "/api/v1/auth/munge",
        "/api/v1/auth/ldap",
        "/api/v1/auth/proxy",
    }
)
PUBLIC_PREFIXES = (f"{ASSETS_PREFIX}/",)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The bodies a page may POST to another site without a CORS preflight.
CROSS_SITE_BODIES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


CODE_UPLOAD_PATH = "/api/v1/code"  # takes archives up to TORCHYARD_MAX_CODE_BYTES, not JSON


def body_limit(path: str, settings: Settings) -> tuple[int, str]:
    """The most bytes a request to `path` may send, and the setting that says so."""
    if path == CODE_UPLOAD_PATH:
        return settings.max_code_bytes, "TORCHYARD_MAX_CODE_BYTES"
    return settings.max_body_bytes, "TORCHYARD_MAX_BODY_BYTES"


def too_large(limit: int, setting: str = "TORCHYARD_MAX_BODY_BYTES") -> str:
    return f"the request body is over this service's limit of {limit} bytes ({setting})"


class RequestGate:
    """Plain ASGI, outside every route: a refusal here never reaches FastAPI's body parsing."""

    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self._app = app
        self._settings = settings
        self._lookups: dict[str, asyncio.Task[Principal]] = {}  # token -> its lookup in flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":  # the service has none: nothing unchecked gets through
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":  # lifespan
            await self._app(scope, receive, send)
            return
        headers = _headers(scope)
        limit, setting = body_limit(scope["path"], self._settings)
        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0  # the HTTP parser refuses a malformed length before the app is called
        try:
            if declared > limit:
                raise TooLarge(too_large(limit, setting))
            if self._settings.dev_mode:
                _check_dev_caller(scope, headers)
                scope[PRINCIPAL] = DEV_PRINCIPAL
            elif not is_public(scope["path"]):
                scope[PRINCIPAL] = await self._token_caller(scope, headers.get("authorization"))
        except ServiceError as error:
            response = service_error_response(error)
            if isinstance(error, TooLarge):  # the client may still be sending: it need not finish
                response.headers["Connection"] = "close"
            await response(scope, receive, send)
            return
        except OperationalError as error:  # the token could not be looked up
            runtime = scope["app"].state.runtime
            await database_down_response(error, runtime.settings)(scope, receive, send)
            return
        await self._app(scope, _limited(receive, limit, setting), send)

    async def _token_caller(self, scope: Scope, authorization: str | None) -> Principal:
        raw = bearer_token(authorization)
        tokens = scope["app"].state.runtime.tokens
        principal: Principal | None = tokens.cached(raw)
        if principal is not None:
            if tokens.due(raw):
                # Ahead of time: waited on when the answer ran out, the lookup's thread starved for
                # the GIL under load and every request of the token waited behind it (bench.scale,
                # PostgreSQL).
                self._lookup(tokens, raw)
            return principal
        # shield: a caller that hangs up must not cancel the lookup the others are waiting for
        return await asyncio.shield(self._lookup(tokens, raw))

    def _lookup(self, tokens: TokenCheck, raw: str) -> asyncio.Future[Principal]:
        """The token's lookup in flight, or a new one: one indexed read, off the event loop, that
        every request for it awaits."""
        lookup = self._lookups.get(raw)
        if lookup is None:
            lookup = asyncio.ensure_future(run_in_threadpool(tokens.lookup, raw))
            self._lookups[raw] = lookup
            lookup.add_done_callback(functools.partial(self._looked_up, raw))
        return lookup

    def _looked_up(self, raw: str, lookup: asyncio.Future[Principal]) -> None:
        self._lookups.pop(raw, None)
        if not lookup.cancelled():
            lookup.exception()  # seen here: a lookup made ahead may have no request awaiting it


def _headers(scope: Scope) -> dict[str, str]:
    """Header names lower-cased (ASGI's are already); of a repeated header, the first."""
    out: dict[str, str] = {}
    for name, value in scope["headers"]:
        out.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return out


def _check_dev_caller(scope: Scope, headers: dict[str, str]) -> None:
    peer = scope["client"][0] if scope.get("client") else ""
    if not is_loopback(peer):
        raise Forbidden("this service runs in dev mode and answers only this machine")
    host = headers.get("host", "")
    if not is_loopback(urlsplit(f"//{host}").hostname or ""):
        raise Forbidden(
            f"this service runs in dev mode and answers only to a loopback name (localhost, 127.0.0.1), "
            f"not Host {host!r}"
        )
    origin = headers.get("origin")
    if origin is not None and origin != f"{scope['scheme']}://{host}":
        raise Forbidden(f"this service runs in dev mode and answers no page of another site ({origin!r})")
    media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
    if scope["method"] not in SAFE_METHODS and media_type in CROSS_SITE_BODIES:
        raise Forbidden(
            f"this service runs in dev mode and takes no {media_type} body: send application/json"
        )


def _limited(receive: Receive, limit: int, setting: str) -> Receive:
    """`receive` that refuses the body once more than `limit` bytes of it have come."""
    received = 0

    async def receive_limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                # HTTPException: FastAPI passes it through its body reading (service.api.errors maps it)
                raise HTTPException(413, too_large(limit, setting))
        return message

    return receive_limited


def principal_of(scope: MutableMapping[str, Any]) -> Principal:
    """The caller the gate found; a route on a public path has none and may not ask for one."""
    principal: Principal | None = scope.get(PRINCIPAL)
    if principal is None:
        raise Unauthenticated("send an API token: 'Authorization: Bearer <token>'")
    return principal
