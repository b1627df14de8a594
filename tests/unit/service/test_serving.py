"""How the guarded protocol (service.serving) ends connections when the server, not the client, is slow.

A tiny ASGI app over real sockets on uvicorn with the service's protocol and event loop (uvloop).
`/hold` makes the server slow the way a busy one is: its loop is away while a connection's deadline
passes, then runs the deadline's timer late. uvloop runs the timers that are due before it reads
the sockets again, so bytes a client sent meanwhile sit unread when the deadline's handler runs; a
plain close then, with bytes unread, makes the kernel send RST instead of FIN, and the client hears
a reset (httpx.ReadError) on a request the server had not refused: to it, the server crashed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qsl

import httpx
import pytest

from service.config import Settings
from service.embedded import EmbeddedService

KEEP_ALIVE_S = 1
READ_TIMEOUT_S = 1.0
REQUEST = b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n"


def sleep_until(moment: float) -> None:
    time.sleep(max(0.0, moment - time.monotonic()))


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """`/ok` answers at once. `/hold?at=A&until=B` (time.monotonic() values) holds the event loop in
    this step until A + 0.4, and in a timer due at A until B: the loop is away past A + 0.4, and
    when it comes back, every timer due by then runs before it reads a socket again."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/hold":
        query = dict(parse_qsl(scope["query_string"].decode()))
        at, until = float(query["at"]), float(query["until"])
        asyncio.get_running_loop().call_later(max(0.0, at - time.monotonic()), sleep_until, until)
        sleep_until(at + 0.4)  # blocking on purpose: the loop serves nothing meanwhile
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def url() -> Iterator[str]:
    limits = {"keep_alive_s": KEEP_ALIVE_S, "request_read_timeout_s": READ_TIMEOUT_S}
    settings = Settings().model_copy(update={"host": "127.0.0.1", "port": 0, **limits})  # 0: a free port
    with EmbeddedService(settings, app=app) as service:
        yield service.url


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def answer(sock: socket.socket) -> bytes:
    """What the server sends until it has sent one whole answer to /ok, or closes."""
    received = b""
    while not received.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        received += chunk
    return received


def hold_the_loop_over(url: str, deadline: float) -> socket.socket:
    """Another client's request that keeps the server's loop away from 0.2 s before `deadline`
    until 1.5 s after it, then has it run the deadline's timer before anything else."""
    hold = connect(url)
    hold.sendall(f"GET /hold?at={deadline - 0.2}&until={deadline + 1.5} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return hold


def test_a_request_that_came_while_the_loop_was_late_for_the_keep_alive_is_answered(url: str) -> None:
    with connect(url) as sock:
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200 ")
        keep_alive_ends = time.monotonic() + KEEP_ALIVE_S  # the server's is a little earlier
        with hold_the_loop_over(url, keep_alive_ends):
            sleep_until(keep_alive_ends + 0.8)
            sock.sendall(REQUEST)  # the server has not acted on its deadline: the connection is open
            assert answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_request_that_came_while_the_loop_was_late_for_the_read_deadline_is_answered(url: str) -> None:
    with connect(url) as sock:
        read_deadline = time.monotonic() + READ_TIMEOUT_S
        with hold_the_loop_over(url, read_deadline):
            sleep_until(read_deadline + 0.8)
            sock.sendall(REQUEST)
            assert answer(sock).startswith(b"HTTP/1.1 200 ")


def test_a_request_sent_on_a_connection_the_server_has_closed_hears_a_clean_end(url: str) -> None:
    """What a client's retry rests on (service.client): a request that crossed the server's close of
    an idle connection gets an end before any answer (EOF), not a reset."""
    with connect(url) as sock:
        sock.sendall(REQUEST)
        assert answer(sock).startswith(b"HTTP/1.1 200 ")
        time.sleep(KEEP_ALIVE_S + 0.5)  # the server has closed its side by now
        sock.sendall(REQUEST)
        time.sleep(0.3)  # the server's answer to those bytes, if any, has arrived
        assert sock.recv(65536) == b""  # a reset raises ConnectionResetError here


def test_the_server_keeps_an_idle_connection_longer_than_an_httpx_client_does() -> None:
    """Else the server's close may cross the client's next request on the connection it still trusts."""
    expiry = httpx.Limits().keepalive_expiry
    assert expiry is not None and Settings().keep_alive_s > expiry
