"""The client makes a request again when its connection fails, if the request may be made twice.

A real server on a socket that drops the first connection(s) it is sent a request on, the two ways
a server's close can meet a request: a reset (RST: httpx.ReadError) or an end before any answer
(FIN: httpx.RemoteProtocolError). The server answers later requests with a job.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from service.client import TorchyardClient, TorchyardError
from service.client.wire import RETRY_WAITS_S, retryable

JOB = {"id": 7, "name": "j", "state": "queued"}


class DroppingServer:
    """HTTP/1.1 on 127.0.0.1, one request a connection; drops the connection under the first `drops`
    requests (`how`: "reset" or "close") and answers the rest 200 with JOB."""

    def __init__(self, drops: int, how: str) -> None:
        self.drops = drops
        self.how = how
        self.requests: list[tuple[str, dict[str, str]]] = []  # (request line, headers) as they came
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed: the test is over
                return
            with connection:
                self._answer(connection)

    def _answer(self, connection: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = connection.recv(65536)
            if not chunk:
                return
            head += chunk
        line, *fields = head.split(b"\r\n\r\n")[0].decode().split("\r\n")
        headers = {name.lower(): value.strip() for name, _, value in (f.partition(":") for f in fields)}
        self.requests.append((line, headers))
        if self.drops > 0:
            self.drops -= 1
            if self.how == "reset":  # close with SO_LINGER 0: the kernel sends RST
                connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        body = json.dumps(JOB).encode()
        connection.sendall(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )

    def close(self) -> None:
        self._listener.close()


@pytest.fixture(params=["reset", "close"])
def how(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dropped_once(how: str) -> Iterator[DroppingServer]:
    server = DroppingServer(drops=1, how=how)
    yield server
    server.close()


def client_of(server: DroppingServer) -> TorchyardClient:
    return TorchyardClient(server.url, token="t", timeout=10)


def test_a_get_is_made_again_after_its_connection_was_dropped(dropped_once: DroppingServer) -> None:
    with client_of(dropped_once) as client:
        assert client.get(7) == JOB
    assert [line for line, _ in dropped_once.requests] == ["GET /api/v1/jobs/7 HTTP/1.1"] * 2


def test_a_post_with_an_idempotency_key_is_made_again_with_the_same_key(dropped_once: DroppingServer) -> None:
    with client_of(dropped_once) as client:
        assert client.submit({"name": "j", "entrypoint": "m:f"}, idempotency_key="k-1") == JOB
    assert [headers["idempotency-key"] for _, headers in dropped_once.requests] == ["k-1", "k-1"]


def test_a_post_without_an_idempotency_key_is_never_made_twice(dropped_once: DroppingServer) -> None:
    with client_of(dropped_once) as client, pytest.raises(TorchyardError, match="cannot reach torchyard"):
        client.submit({"name": "j", "entrypoint": "m:f"})
    assert len(dropped_once.requests) == 1  # the service may have made the job: a second could be another


def test_a_connection_that_keeps_failing_is_given_up_after_a_few_tries(how: str) -> None:
    server = DroppingServer(drops=100, how=how)
    try:
        with client_of(server) as client, pytest.raises(TorchyardError, match="cannot reach torchyard"):
            client.get(7)
    finally:
        server.close()
    assert len(server.requests) == 1 + len(RETRY_WAITS_S)


def test_which_requests_may_be_made_again() -> None:
    assert retryable("GET", None) and retryable("put", {}) and retryable("DELETE", None)
    assert retryable("POST", {"idempotency-key": "k"}) and retryable("POST", {"Idempotency-Key": "k"})
    assert not retryable("POST", None) and not retryable("POST", {"Content-Type": "application/json"})
    assert not retryable("PATCH", {"Idempotency-Key": "k"})
