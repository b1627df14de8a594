"""One try of one webhook delivery: checked, pinned to the checked address, and bounded in total.

- Checked: the URL against the operator's host and port lists, its host resolved now
  (service.domain.webhook_hosts); a refusal fails the delivery for good.
- Pinned: the connection goes to an address that check approved, never to a second lookup's answer
  (a name that resolves to a public address once and to 127.0.0.1 the next time cannot slip
  through). The URL, and so the Host header and the TLS server name the certificate is checked
  against, stay the name's.
- Bounded: one wall-clock deadline (TORCHYARD_WEBHOOK_TOTAL_TIMEOUT_S) for connect, send and answer
  together. A per-read timeout alone never cuts a receiver that sends a byte every few seconds;
  here every read and write may wait only for what is left of the deadline.
- Told nothing back: a receiver's answer is its status code. Its body and a redirect's Location are
  never read or kept: `last_error`, which the subscriber reads, must not carry what an internal
  service said, nor tell an open port from a closed one beyond a generic class of error.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import httpcore

from service.domain import webhook_events, webhook_hosts
from service.domain.deliveries import Claimed, Outcome
from service.domain.notifications import REMOVED

Resolver = Callable[[str, int], list[str]]
TIMED_OUT = "timed out (the receiver did not answer within the deadline)"
NO_CONNECTION = "could not connect"
BROKEN = "the connection failed"


@dataclass(frozen=True)
class Limits:
    connect_s: float
    read_s: float
    total_s: float


def send(
    claimed: Claimed,
    rules: webhook_hosts.HostRules,
    limits: Limits,
    tls: ssl.SSLContext,
    resolver: Resolver | None = None,
) -> Outcome:
    """POST one delivery; how it went (never raises for anything the receiver does)."""
    if claimed.secret is None:
        return Outcome(False, error=REMOVED, permanent=True)
    deadline = time.monotonic() + limits.total_s
    try:
        target = webhook_hosts.check_url(claimed.url, rules, resolver)
    except webhook_hosts.Unresolved as unresolved:  # DNS may be back on the next try
        return Outcome(False, error=str(unresolved))
    except webhook_hosts.Refused as refused:
        return Outcome(False, error=f"refused: {refused}", permanent=True)
    body = webhook_events.body_bytes(claimed.payload)
    headers = webhook_events.headers(claimed.secret, body, claimed.delivery_id, claimed.event)
    timeouts = {"connect": limits.connect_s, "read": limits.read_s, "write": limits.read_s}
    pool = httpcore.ConnectionPool(ssl_context=tls, network_backend=PinnedBackend(target, deadline))
    sent = list(headers.items())
    try:
        with (
            pool,
            pool.stream(
                "POST", claimed.url, headers=sent, content=body, extensions={"timeout": timeouts}
            ) as response,
        ):
            return outcome_of(response.status)
    except httpcore.TimeoutException:
        return Outcome(False, error=TIMED_OUT)
    except httpcore.ConnectError:
        return Outcome(False, error=NO_CONNECTION)
    except (httpcore.NetworkError, httpcore.ProtocolError, ssl.SSLError, OSError):
        return Outcome(False, error=BROKEN)


def outcome_of(status: int) -> Outcome:
    """2xx delivered; anything else a failed try, said by its status code alone."""
    if 200 <= status < 300:
        return Outcome(True, status=status)
    if 300 <= status < 400:
        return Outcome(False, status=status, error=f"HTTP {status}: redirects are not followed")
    return Outcome(False, status=status, error=f"HTTP {status}")


class PinnedBackend(httpcore.NetworkBackend):
    """Connects to the target's checked addresses (whatever host httpcore asks for), and bounds
    every connect, read, write and TLS handshake by what is left of one deadline."""

    def __init__(self, target: webhook_hosts.Target, deadline: float) -> None:
        self._target = target
        self._deadline = deadline
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        assert port == self._target.port, "the URL checked is the URL sent"
        failed: httpcore.ConnectError | None = None
        for address in self._target.addresses:  # each checked one in turn, as a resolver's list is tried
            left = left_of(self._deadline, timeout, httpcore.ConnectTimeout)
            try:
                stream = self._inner.connect_tcp(address, port, left, local_address, socket_options)
            except httpcore.ConnectError as error:
                failed = error
                continue
            return DeadlineStream(stream, self._deadline)
        raise failed or httpcore.ConnectError("no address")

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[Any] | None = None
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("webhooks reach TCP addresses only")

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, max(0.0, self._deadline - time.monotonic())))


class DeadlineStream(httpcore.NetworkStream):
    def __init__(self, inner: httpcore.NetworkStream, deadline: float) -> None:
        self._inner = inner
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, left_of(self._deadline, timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, left_of(self._deadline, timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        left = left_of(self._deadline, timeout, httpcore.ConnectTimeout)
        return DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, left), self._deadline)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def left_of(deadline: float, timeout: float | None, late: type[httpcore.TimeoutException]) -> float:
    """The timeout one network step may use: its own, cut to what is left of the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise late("the delivery's total deadline passed")
    return left if timeout is None else min(timeout, left)
