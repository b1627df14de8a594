"""A real HTTP receiver for webhooks on 127.0.0.1 (a ThreadingHTTPServer on a thread of the test): it
records every POST (headers, raw body, when it came) and answers with the statuses it is told, 200 once
they run out (a 3xx with a Location, anything else with a body, both carrying a token that must not
leak). And a slow-drip receiver that answers a byte a second, never done."""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    arrived_at: float = field(default_factory=time.time)  # when its body was read (wall clock)

    @property
    def json(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.body)
        return value


TOKEN = "tok-3f9a-internal-only"  # in every answer's body and Location: never stored by the service


@dataclass
class Receiver:
    port: int
    answers: list[int] = field(default_factory=list)  # statuses to answer, in order; then 200
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def at(self, host: str) -> str:
        return f"http://{host}:{self.port}/hook"

    def taken(self) -> list[Received]:
        """The POSTs answered 2xx."""
        with self.lock:
            return [one for one in self.received if one.headers.get("x-answered", "").startswith("2")]

    def all(self) -> list[Received]:
        with self.lock:
            return list(self.received)


@contextmanager
def receiving(
    answers: list[int] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    tls: ssl.SSLContext | None = None,
) -> Iterator[Receiver]:
    """A receiver on `host` (a free port unless one is named; HTTPS with `tls`) until the block ends."""
    holder: list[Receiver] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            receiver = holder[0]
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            with receiver.lock:
                status = receiver.answers.pop(0) if receiver.answers else 200
                headers = {key.lower(): value for key, value in self.headers.items()}
                headers["x-answered"] = str(status)
                receiver.received.append(Received(self.path, headers, body))
            self.send_response(status)
            if 300 <= status < 400:
                self.send_header("Location", f"http://127.0.0.1:1/elsewhere?token={TOKEN}")
            said = b"ok" if status < 300 else f"internal admin says no; token={TOKEN}".encode()
            self.send_header("Content-Length", str(len(said)))
            self.end_headers()
            self.wfile.write(said)

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

    server = ThreadingHTTPServer((host, port), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
    holder.append(Receiver(server.server_address[1], list(answers or [])))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Drip:
    port: int
    connected: threading.Event = field(default_factory=threading.Event)  # a POST arrived

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/slow"


@contextmanager
def dripping(every_s: float = 1.0) -> Iterator[Drip]:
    """A receiver that reads a request, then answers a byte every `every_s` and never finishes its
    status line: a per-read timeout never fires on it. Until the block ends."""
    listener = socket.create_server(("127.0.0.1", 0))
    drip = Drip(listener.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            conn.recv(65536)
            drip.connected.set()
            answer = b"HTTP/1.1 200 OK-but-very-slowly" + b"." * 10_000
            for byte in answer:
                if stop.wait(every_s):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:  # the service hung up
                    return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield drip
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=5)
