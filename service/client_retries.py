"""Which of the client's requests are made again when the connection fails under them, and when.

A kept-alive connection can be closed by the service just as the client reuses it (the request then
meets a reset, or an end before any answer), and a service restarting refuses connections for a
moment: the request got no answer, and the service may or may not have acted on it. One that may
safely be made twice is made again, a few times, a little later each time: the idempotent methods,
and a POST with an Idempotency-Key (the service answers its second with what the first made). A
POST without one is never made twice: it could make two jobs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import httpx

RETRY_WAITS_S = (0.1, 0.3, 1.0)  # before each try after the first
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})
# No answer came: refused, reset, or closed before a byte of one. Not a timeout: a request that took
# too long would take too long again, and the caller set how long it may wait.
CONNECTION_FAILURES = (httpx.ConnectError, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

log = logging.getLogger(__name__)


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
