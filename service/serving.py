"""How uvicorn serves the app: one configuration for `torchyard serve` and the embedded service.

uvicorn bounds an idle connection only between requests (`timeout_keep_alive`), and its httptools
parser takes headers of any size at any pace: a client sending one header line every few seconds
holds a connection, and a task, for as long as it likes. GuardedHttpTools bounds both:
- a request must arrive whole (request line, headers and body) within `request_read_timeout_s` of
  its first byte; a new connection must send one within that long too;
- the request line and headers may take `max_header_bytes`; more is answered 431.
The time a route then takes (a long poll waits up to 30 s) is not counted: the request has arrived.

A deadline is the client's, never the server's: when its timer runs, bytes the client has sent that
the loop has not read yet keep the connection open (`unread_bytes_waiting`). A busy loop runs its
timers late, and uvloop runs those due before it reads the sockets again; closing then, with bytes
unread, makes the kernel send RST instead of FIN, and the client hears a reset (httpx.ReadError) on
a request the server had not refused, as from a crash. Under tests/integration/test_load.py on
PostgreSQL on 2 busy cores, 1 in 72 keep-alive closes found the client's next request waiting.
Forwarding headers are the app's business (service.app, TORCHYARD_TRUSTED_PROXIES), not uvicorn's.

`serve` is how a process that is the service runs it (`torchyard serve`): that process's heap is the
service's, so what start-up made is frozen out of garbage collection (ServiceProcess). The embedded
service (a thread in the demo's or a test's process) runs a plain uvicorn.Server on the same config.
"""

from __future__ import annotations

import asyncio
import gc
import json
import select
import socket
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.errors import error_body
from service.api.watch import SHUTDOWN_GRACE_S
from service.config import Settings

RECHECK_S = 0.05  # a read deadline that found unread bytes looks again this much later...
MAX_RECHECKS = 20  # ...this many times at most: 1 s past the deadline, for a client that dribbles


def uvicorn_config(app: Any, settings: Settings, **options: Any) -> uvicorn.Config:
    """`options`: uvicorn.Config's own (host, port, log_level, access_log)."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(settings),
        proxy_headers=False,
        timeout_keep_alive=settings.keep_alive_s,
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        **options,
    )


def serve(app: Any, settings: Settings, **options: Any) -> None:
    """Serve `app` in this process until SIGINT or SIGTERM; `options` as for uvicorn_config."""
    ServiceProcess(uvicorn_config(app, settings, **options)).run()


class ServiceProcess(uvicorn.Server):
    """uvicorn's server, for a process that does nothing but serve: once started, what start-up made
    (modules, the app, the runtime) is left out of every later garbage collection.

    Each full collection walked all of it and paused the event loop meanwhile: serving a large
    ledger (bench.scale), those pauses made much of the reads' tail latency (docs/performance.md,
    Figures behind the design). Not in the embedded service: the heap there is also its host's (a
    test process starts hundreds of apps), and nothing there is measured for latency.
    """

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        gc.freeze()


def guarded_protocol(settings: Settings) -> type[HttpToolsProtocol]:
    class Guarded(GuardedHttpTools):
        read_timeout_s = settings.request_read_timeout_s
        max_head_bytes = settings.max_header_bytes

    return Guarded


class GuardedHttpTools(HttpToolsProtocol):
    read_timeout_s: float
    max_head_bytes: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None
        self._reading_head = True  # between requests, and while a request line and headers come
        self._head_bytes = 0
        self._head_tail = b""  # the last bytes seen of a head, in case its end spans two chunks
        self._rechecks = 0  # of this request's read deadline (MAX_RECHECKS)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_deadline()  # a connection that never sends a request is cut too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._reading_head:
            # Count the head only: a chunk may hold its end and the start of the body.
            seen = self._head_tail + data
            end = seen.find(b"\r\n\r\n")
            self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._head_tail))
            self._head_tail = seen[-3:] if end < 0 else b""
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, f"the request line and headers are over {self.max_head_bytes} bytes")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_read_deadline()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm_read_deadline()
        self._reading_head, self._head_bytes, self._head_tail, self._rechecks = True, 0, b"", 0
        super().on_message_complete()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's, but a connection whose client has spoken is not idle, however late we look."""
        if self.transport.is_closing():
            return
        if unread_bytes_waiting(self.transport):  # data_received, in a moment, disarms this again
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )
            return
        self.transport.close()

    def _arm_read_deadline(self) -> None:
        if self._read_deadline is None:
            self._read_deadline = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm_read_deadline(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        if self._rechecks < MAX_RECHECKS and unread_bytes_waiting(self.transport):
            self._rechecks += 1  # the bytes came in time; the loop is late to read them
            self._read_deadline = self.loop.call_later(RECHECK_S, self._read_timed_out)
            return
        if self._reading_head and self._head_bytes:
            self._refuse(408, f"the request did not arrive within {self.read_timeout_s:g} s")
        else:
            self.transport.close()  # idle, or a body too slow: the app's receive hears a disconnect

    def _refuse(self, status: int, message: str) -> None:
        """Answer before any app saw the request, and close: the client is not keeping to HTTP's pace."""
        if self.transport.is_closing():
            return
        body = json.dumps(error_body(message)).encode()
        reason = {408: "Request Timeout", 431: "Request Header Fields Too Large"}[status]
        head = (
            f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + body)
        self.transport.close()


def unread_bytes_waiting(transport: asyncio.BaseTransport) -> bool:
    """True when the peer has sent bytes (or its close) that the event loop has not read yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))
