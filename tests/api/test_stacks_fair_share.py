"""Stacks captures hold nothing another user needs (issue 43, finding 1): over real HTTP to real
uvicorn, a flood of stacks requests against one running job whose ranks do not answer holds no API
thread (`/healthz` and another user's read stay within a small bound of their quiet values, measured
here), the flood past the caps gets 429 with Retry-After, one user's captures stop at
TORCHYARD_MAX_CAPTURES_PER_USER while another user's still start, and a waiter whose capture does
not end by its deadline gets 409 with Retry-After. The ranks' side is scripted (tests.fakes): the
signal is held until the test lets it go."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.backends.base import StackRequest
from service.config import Settings
from service.domain import capture, captures
from tests.api.test_metrics import sample
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve
from tests.support import wait_for

JOBS = "/api/v1/jobs"
READ = "/api/v1/notifications/subscriptions"  # another user's read on the API's threads
FLOOD = 200
BOUND_S = 0.5  # what a held flood may add to a quiet answer (before: 3.8 s and 31 s, then no answer)
SEATS = 8  # TORCHYARD_MAX_CAPTURE_WAITERS_PER_USER here


@pytest.fixture
def live(settings: Settings, fake: FakeBackend) -> Iterator[LiveServer]:
    small = settings.model_copy(update={"max_capture_waiters_per_user": SEATS, "max_captures_per_user": 2})
    with serve(create_app(small, backends={"local": fake})) as server:
        yield server


class HeldSignal:
    """The backend's signal for stacks, held until released: the capture under way stays under way.
    Released, the ranks write nothing (they ignore the signal)."""

    def __init__(self, fake: FakeBackend) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        fake.on_stacks = self

    def __call__(self, job: StackRequest) -> bool:
        self.entered.set()
        self.release.wait(30)
        return True


def running_job(client: httpx.Client) -> int:
    body = {"name": "deaf", "entrypoint": "worker.tasks.seed:ddp_step"}
    response = client.post(JOBS, json=body)
    assert response.status_code == 201, response.text
    job_id = int(response.json()["id"])
    wait_for(lambda: client.get(f"{JOBS}/{job_id}").json()["state"] == "running", 10, "the job to run")
    return job_id


def timed(call: Callable[[], httpx.Response], times: int = 5) -> float:
    """The median time of `call` (each answer a 200); a call that got no answer counts as forever."""
    took = []
    for _ in range(times):
        started = time.monotonic()
        try:
            response = call()
        except httpx.TimeoutException:
            took.append(float("inf"))
            continue
        took.append(time.monotonic() - started)
        assert response.status_code == 200, response.text
    return statistics.median(took)


def flood(live: LiveServer, job_id: int, answers: list[httpx.Response]) -> threading.Thread:
    """FLOOD stacks requests of alice's at once, on a thread; each answer appended as it comes."""

    async def all_at_once() -> None:
        limits = httpx.Limits(max_connections=FLOOD)
        async with httpx.AsyncClient(base_url=live.url, headers=live.login(), limits=limits, timeout=60) as c:

            async def one() -> None:
                answers.append(await c.get(f"{JOBS}/{job_id}/stacks"))

            await asyncio.gather(*(one() for _ in range(FLOOD)))

    thread = threading.Thread(target=asyncio.run, args=(all_at_once(),), daemon=True)
    thread.start()
    return thread


def test_a_flood_of_stacks_requests_holds_no_api_thread_and_is_refused_past_its_seats(
    live: LiveServer, fake: FakeBackend
) -> None:
    alice, bob = live.client("alice", timeout=5), live.client("bob", timeout=5)
    job_id = running_job(alice)
    quiet_health = timed(lambda: bob.get("/healthz"))
    quiet_read = timed(lambda: bob.get(READ))
    held = HeldSignal(fake)

    answers: list[httpx.Response] = []
    flooding = flood(live, job_id, answers)
    assert held.entered.wait(20), "no capture began"
    arrived = time.monotonic() + 10  # the flood in: all but the seated answered (before: none)
    while len(answers) < FLOOD - SEATS and time.monotonic() < arrived:
        time.sleep(0.05)
    busy_health = timed(lambda: bob.get("/healthz"), 3)
    busy_read = timed(lambda: bob.get(READ), 3)
    held.release.set()
    flooding.join(30)

    assert busy_health < quiet_health + BOUND_S, (quiet_health, busy_health)
    assert busy_read < quiet_read + BOUND_S, (quiet_read, busy_read)
    statuses = sorted(answer.status_code for answer in answers)
    assert statuses == [200] * SEATS + [429] * (FLOOD - SEATS)  # the seated share one capture
    refused = [answer for answer in answers if answer.status_code == 429]
    assert all(answer.headers["Retry-After"] == "3" for answer in refused)
    assert "TORCHYARD_MAX_CAPTURE_WAITERS_PER_USER" in refused[0].json()["detail"][0]["msg"]
    assert len(fake.stack_calls) == 1  # one capture for the job, whatever the flood
    fresh = [answer.json() for answer in answers if answer.status_code == 200]
    assert all(one["fresh"] and "no stacks" in one["ranks"][0]["note"] for one in fresh)


def test_one_users_captures_stop_at_their_cap_while_another_users_still_start(
    live: LiveServer, fake: FakeBackend
) -> None:
    alice, bob = live.client("alice"), live.client("bob")
    alices = [running_job(alice) for _ in range(3)]
    bobs = running_job(bob)
    held = HeldSignal(fake)
    answers: dict[int, Any] = {}

    def ask(client: httpx.Client, job_id: int) -> None:
        answers[job_id] = client.get(f"{JOBS}/{job_id}/stacks")

    waiting = [threading.Thread(target=ask, args=(alice, job_id)) for job_id in alices[:2]]
    for thread in waiting:
        thread.start()
    wait_for(lambda: live.runtime.captures.under_way() == 2, 10, "alice's two captures")
    third = alice.get(f"{JOBS}/{alices[2]}/stacks")
    waiting.append(threading.Thread(target=ask, args=(bob, bobs)))
    waiting[-1].start()
    wait_for(lambda: live.runtime.captures.under_way() == 3, 10, "bob's capture to start beside them")
    gauge = sample(bob.get("/metrics").text, "torchyard_stack_captures_under_way")
    held.release.set()
    for thread in waiting:
        thread.join(30)

    assert third.status_code == 429 and third.headers["Retry-After"] == "3"
    message = third.json()["detail"][0]["msg"]
    assert "2 stacks captures of alice's jobs are under way" in message
    assert "TORCHYARD_MAX_CAPTURES_PER_USER" in message
    assert [answers[job_id].status_code for job_id in [*alices[:2], bobs]] == [200, 200, 200]
    assert gauge == 3


def test_a_waiter_whose_capture_outlives_its_deadline_gets_409_with_retry_after(
    live: LiveServer, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(captures, "DEADLINE_S", 2.0)
    monkeypatch.setattr(capture, "WAIT_S", 0.5)
    alice = live.client("alice")
    job_id = running_job(alice)
    held = HeldSignal(fake)

    started = time.monotonic()
    answer = alice.get(f"{JOBS}/{job_id}/stacks")
    took = time.monotonic() - started
    held.release.set()

    assert answer.status_code == 409 and answer.headers["Retry-After"] == "3"
    assert "did not end within 2 s" in answer.json()["detail"][0]["msg"]
    # The deadline's 2 s, not the 60 s a sharer used to sit; the rest is room for a loaded machine's
    # request (4.6 s was seen in a CI run beside other tests).
    assert took < 2.0 + captures.SLACK_S + 5.0
    wait_for(lambda: live.runtime.captures.under_way() == 0, 10, "the capture to end")
    again = alice.get(f"{JOBS}/{job_id}/stacks", params={"capture": "false"})
    assert again.status_code == 200 and again.json()["fresh"] is False  # what it captured is kept
