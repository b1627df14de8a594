"""A real HTTP receiver for webhooks on 127.0.0.1 (a ThreadingHTTPServer on a thread of the test): it
records every POST (headers, raw body) and answers with the statuses it is told, 200 once they run out."""

from __future__ import annotations

import json
import threading
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

    @property
    def json(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.body)
        return value


@dataclass
class Receiver:
    port: int
    answers: list[int] = field(default_factory=list)  # statuses to answer, in order; then 200
    received: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def taken(self) -> list[Received]:
        """The POSTs answered 2xx."""
        with self.lock:
            return [one for one in self.received if one.headers.get("x-answered", "").startswith("2")]

    def all(self) -> list[Received]:
        with self.lock:
            return list(self.received)


@contextmanager
def receiving(answers: list[int] | None = None) -> Iterator[Receiver]:
    """A receiver on a free port of 127.0.0.1 until the block ends."""
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
                self.send_header("Location", "http://127.0.0.1:1/elsewhere")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Receiver(server.server_address[1], list(answers or [])))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield holder[0]
    finally:
        server.shutdown()
        server.server_close()
