"""Clients that hold the service's connections: slow or endless headers, idle and slow bodies, and
long polls past their seats. Over real sockets to real uvicorn (service.serving), each bound measured.

The limits are set small here (1 s to arrive, 2 KiB of headers, 1 s of keep-alive, 3 long polls for
a user and 4 in all) so the bounds are measured in seconds; the defaults are in docs/operations.md."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from service.app import create_app
from service.client import TorchyardClient
from service.config import Settings
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve
from tests.support import wait_for

JOBS = "/api/v1/jobs"
READ_TIMEOUT_S = 1.0
KEEP_ALIVE_S = 1
MAX_HEADER_BYTES = 2048
SLACK_S = 1.5  # the event loop's timer and a loaded CI machine


@pytest.fixture
def live(settings: Settings, fake: FakeBackend) -> Iterator[LiveServer]:
    limits = settings.model_copy(
        update={
            "request_read_timeout_s": READ_TIMEOUT_S,
            "keep_alive_s": KEEP_ALIVE_S,
            "max_header_bytes": MAX_HEADER_BYTES,
            "max_long_polls_per_user": 3,
            "max_long_polls": 4,
        }
    )
    with serve(create_app(limits, backends={"local": fake})) as server:
        yield server


def connect(live: LiveServer) -> socket.socket:
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return sock


def closed_after(
    sock: socket.socket, dribble: list[bytes], every_s: float, limit_s: float = 30
) -> tuple[float, bytes]:
    """Send `dribble` one piece every `every_s` seconds (then nothing) until the server closes the
    connection; how long that took, and what it answered."""
    started = time.monotonic()
    answer = b""
    sock.settimeout(every_s)
    pieces = list(dribble)
    while time.monotonic() - started < limit_s:
        if pieces:
            try:
                sock.sendall(pieces.pop(0))
            except OSError:  # closed while we were sending
                break
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            break
        if not chunk:
            break
        answer += chunk
    return time.monotonic() - started, answer


def test_a_request_dribbling_header_lines_is_cut_within_the_read_timeout(live: LiveServer) -> None:
    # One header line every 0.2 s, for longer than any bound: without one, the connection lives on.
    lines = [b"GET /healthz HTTP/1.1\r\nHost: x\r\n", *[b"X-Slow: 1\r\n"] * 100]
    with connect(live) as sock:
        took, answer = closed_after(sock, lines, every_s=0.2)

    assert took < READ_TIMEOUT_S + SLACK_S, f"still open after {took:.1f} s"
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b"did not arrive within 1 s" in answer


def test_a_connection_that_never_sends_a_request_is_closed(live: LiveServer) -> None:
    with connect(live) as sock:
        took, answer = closed_after(sock, [], every_s=0.2)

    assert took < READ_TIMEOUT_S + SLACK_S, f"still open after {took:.1f} s"
    assert answer == b""


def test_an_idle_kept_alive_connection_is_closed(live: LiveServer) -> None:
    with connect(live) as sock:
        took, answer = closed_after(sock, [b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"], every_s=0.2)

    assert answer.startswith(b"HTTP/1.1 200 ")  # served, then closed when idle
    assert took < KEEP_ALIVE_S + SLACK_S, f"still open after {took:.1f} s"


def test_a_body_too_slow_is_cut_within_the_read_timeout(live: LiveServer) -> None:
    head = (
        b"POST /api/v1/jobs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 400\r\n"
    )
    token = live.login()["Authorization"].encode()
    pieces = [head + b"Authorization: " + token + b"\r\n\r\n", *[b"{"] * 100]
    with connect(live) as sock:
        took, _ = closed_after(sock, pieces, every_s=0.2)

    assert took < READ_TIMEOUT_S + SLACK_S, f"still open after {took:.1f} s"
    assert live.runtime.job_watch.waiters() == 0


def test_headers_over_the_limit_get_431(live: LiveServer) -> None:
    big = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * MAX_HEADER_BYTES + b"\r\n\r\n"
    with connect(live) as sock:
        _, answer = closed_after(sock, [big], every_s=0.2)

    assert answer.startswith(b"HTTP/1.1 431 ")
    assert f"over {MAX_HEADER_BYTES} bytes".encode() in answer
    with httpx.Client(base_url=live.url) as client:  # the service is fine
        assert client.get("/healthz", headers={"X-Fine": "a" * 512}).status_code == 200


def test_a_long_poll_is_not_cut_by_the_read_timeout(live: LiveServer, fake: FakeBackend) -> None:
    with live.client() as client:
        job_id = client.post(JOBS, json={"name": "p", "entrypoint": "worker.tasks.seed:ddp_step"}).json()[
            "id"
        ]
        wait_for(lambda: client.get(f"{JOBS}/{job_id}").json()["state"] == "running", what="running")
        tag = client.get(f"{JOBS}/{job_id}").headers["ETag"]
        started = time.monotonic()
        answer = client.get(f"{JOBS}/{job_id}", params={"wait_s": 3}, headers={"If-None-Match": tag})
        took = time.monotonic() - started

    assert answer.status_code == 304
    assert took >= 3 > READ_TIMEOUT_S  # held as long as asked: the request had arrived


def test_long_polls_are_capped_per_user_and_in_total(live: LiveServer, fake: FakeBackend) -> None:
    body = {"name": "p", "entrypoint": "worker.tasks.seed:ddp_step"}
    with live.client("alice") as alice, live.client("bob") as bob:
        job_id = alice.post(JOBS, json=body).json()["id"]
        bobs_id = bob.post(JOBS, json=body).json()["id"]
        wait_for(lambda: alice.get(f"{JOBS}/{job_id}").json()["state"] == "running", what="running")
        wait_for(lambda: bob.get(f"{JOBS}/{bobs_id}").json()["state"] == "running", what="running")
        tags = {job_id: alice.get(f"{JOBS}/{job_id}").headers["ETag"],
                bobs_id: bob.get(f"{JOBS}/{bobs_id}").headers["ETag"]}  # fmt: skip

        def poll(client: httpx.Client, which: int) -> httpx.Response:
            params = {"wait_s": 4}
            return client.get(f"{JOBS}/{which}", params=params, headers={"If-None-Match": tags[which]})

        with ThreadPoolExecutor(8) as pool:
            alices = [pool.submit(poll, live.client("alice"), job_id) for _ in range(3)]
            wait_for(lambda: live.runtime.job_watch.waiters() == 3, what="alice's three polls held")
            alice_fourth = poll(alice, job_id)
            bobs_first = pool.submit(poll, bob, bobs_id)
            wait_for(lambda: live.runtime.job_watch.waiters() == 4, what="bob's poll held")
            bobs_second = poll(live.client("bob"), bobs_id)
            held = [future.result() for future in [*alices, bobs_first]]

    assert alice_fourth.status_code == 429
    assert "the limit is 3 (TORCHYARD_MAX_LONG_POLLS_PER_USER)" in alice_fourth.text
    assert alice_fourth.headers["Retry-After"] == "1"
    assert bobs_second.status_code == 429  # bob holds one, but the service holds four
    assert "its limit (TORCHYARD_MAX_LONG_POLLS)" in bobs_second.text
    assert [answer.status_code for answer in held] == [304] * 4
    assert live.runtime.job_watch.waiters() == 0  # every seat given back


def test_the_client_waits_on_with_plain_reads_when_every_seat_is_taken(
    live: LiveServer, fake: FakeBackend
) -> None:
    body = {"name": "p", "entrypoint": "worker.tasks.seed:ddp_step"}
    with live.client("alice") as alice:
        job_id = alice.post(JOBS, json=body).json()["id"]
        wait_for(lambda: alice.get(f"{JOBS}/{job_id}").json()["state"] == "running", what="running")
        tag = alice.get(f"{JOBS}/{job_id}").headers["ETag"]
        token = alice.headers["Authorization"].removeprefix("Bearer ")

        def hold() -> httpx.Response:
            with live.client("alice") as other:
                return other.get(f"{JOBS}/{job_id}", params={"wait_s": 6}, headers={"If-None-Match": tag})

        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(hold) for _ in range(3)]
            wait_for(lambda: live.runtime.job_watch.waiters() == 3, what="alice's three polls held")
            client = TorchyardClient(live.url, token=token)
            threading.Timer(1.0, fake.finish, args=(job_id, {"ok": True})).start()
            started = time.monotonic()
            done = client.wait(job_id, timeout_s=20)
            took = time.monotonic() - started
            assert all(future.result().status_code == 200 for future in held)  # woken by the end

    assert done["state"] == "succeeded"
    assert took < 5, f"{took:.1f} s: the client did not keep reading while the seats were taken"


@pytest.mark.parametrize("size", [10_000, 40_000, 200_000])
def test_a_body_is_not_counted_as_headers(live: LiveServer, size: int) -> None:
    """The header limit counts the head only: POSTs far over it in body bytes (under the body and
    kwargs limits) reach the route, sent by httpx and as one raw write of head and body together."""
    job = {"name": "big", "entrypoint": "worker.tasks.seed:ddp_step", "kwargs": {"pad": "x" * size}}
    body = json.dumps(job).encode()
    with live.client() as client:
        sent = client.post(JOBS, content=body, headers={"Content-Type": "application/json"})
        assert sent.status_code == 201, sent.text
    head = "\r\n".join([
        f"POST {JOBS} HTTP/1.1", "Host: x", "Content-Type: application/json",
        f"Authorization: {live.login()['Authorization']}", f"Content-Length: {len(body)}",
        "Connection: close",
    ])  # fmt: skip
    with connect(live) as sock:
        _, answer = closed_after(sock, [head.encode() + b"\r\n\r\n" + body], every_s=0.5)
    assert answer.startswith(b"HTTP/1.1 201 "), answer[:200]
