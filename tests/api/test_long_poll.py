"""Long polls on one job: GET /api/v1/jobs/{id}?wait_s=S with a current If-None-Match.

Over real HTTP (uvicorn in a thread): the request is held on the event loop while the loops commit.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from service.api.watch import JobWatch
from service.app import create_app
from service.config import Settings
from service.domain.transitions import record_transition
from service.ledger.db import make_engine, session_scope
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve
from tests.support import wait_for

JOBS = "/api/v1/jobs"
BODY = {"name": "long-poll", "entrypoint": "worker.tasks.seed:ddp_step"}


@pytest.fixture
def live(settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend) -> Iterator[LiveServer]:
    with serve(create_app(settings, backends={"local": fake, "slurm": fake_slurm})) as server:
        yield server


def running_job(client: httpx.Client) -> tuple[int, str]:
    """A job the fake backend runs, and the ETag of its running state."""
    job_id = int(client.post(JOBS, json=BODY).raise_for_status().json()["id"])
    wait_for(lambda: client.get(f"{JOBS}/{job_id}").json()["state"] == "running", what="running")
    return job_id, client.get(f"{JOBS}/{job_id}").headers["ETag"]


def long_poll(client: httpx.Client, job_id: int, tag: str, wait_s: float) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = client.get(f"{JOBS}/{job_id}", params={"wait_s": wait_s}, headers={"If-None-Match": tag})
    return answer, time.monotonic() - started


def in_background(work: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(work()))
    thread.start()
    return thread, out


def held_poll(
    live: LiveServer, client: httpx.Client, job_id: int, tag: str, wait_s: float
) -> tuple[threading.Thread, list[Any]]:
    """A long poll started on a thread, returned once the service holds it."""
    thread, out = in_background(lambda: long_poll(client, job_id, tag, wait_s=wait_s))
    wait_for(lambda: live.runtime.job_watch.waiters() == 1, what="the poll to be held")
    return thread, out


def test_a_long_poll_answers_when_the_job_ends_not_when_the_wait_does(
    live: LiveServer, fake: FakeBackend
) -> None:
    with live.client() as client:
        job_id, tag = running_job(client)
        thread, out = held_poll(live, client, job_id, tag, wait_s=25)
        fake.finish(job_id, {"ok": True})
        thread.join(timeout=30)
        answer, took = out[0]
    assert answer.status_code == 200, answer.text
    assert answer.json()["state"] == "succeeded"
    assert answer.headers["ETag"] != tag
    assert took < 15, f"{took:.1f} s: the answer waited for the timeout, not for the change"
    assert live.runtime.job_watch.waiters() == 0


def test_a_cancel_ends_a_long_poll_on_that_job(live: LiveServer) -> None:
    with live.client() as client:
        job_id, tag = running_job(client)
        thread, out = held_poll(live, client, job_id, tag, wait_s=25)
        with live.client() as other:
            other.post(f"{JOBS}/{job_id}/cancel").raise_for_status()
        thread.join(timeout=30)
    answer, took = out[0]
    assert answer.status_code == 200 and answer.json()["cancel_requested"] is True, answer.text
    assert took < 15


def test_an_unchanged_job_answers_304_once_the_wait_is_over(live: LiveServer) -> None:
    with live.client() as client:
        job_id, tag = running_job(client)
        answer, took = long_poll(client, job_id, tag, wait_s=0.6)
    assert answer.status_code == 304 and answer.headers["ETag"] == tag
    assert took >= 0.6


def test_another_jobs_change_does_not_end_the_wait(live: LiveServer, fake: FakeBackend) -> None:
    with live.client() as client:
        watched, tag = running_job(client)
        other, _ = running_job(client)
        thread, out = held_poll(live, client, watched, tag, wait_s=1.5)
        fake.finish(other, {"ok": True})
        wait_for(lambda: client.get(f"{JOBS}/{other}").json()["state"] == "succeeded", what="the other")
        thread.join(timeout=30)
    answer, took = out[0]
    assert answer.status_code == 304 and took >= 1.5


def test_without_a_current_tag_the_answer_comes_at_once(live: LiveServer) -> None:
    with live.client() as client:
        job_id, _ = running_job(client)
        started = time.monotonic()
        plain = client.get(f"{JOBS}/{job_id}", params={"wait_s": 20})
        stale = client.get(f"{JOBS}/{job_id}", params={"wait_s": 20}, headers={"If-None-Match": '"j1.0"'})
        took = time.monotonic() - started
    assert plain.status_code == 200 and stale.status_code == 200
    assert plain.json()["state"] == "running"
    assert took < 10


def test_a_change_made_by_another_replica_is_seen_within_the_recheck(
    live: LiveServer, settings: Settings
) -> None:
    """Another replica's commit does not wake this one: the held poll reads the job again every second."""
    with live.client() as client:
        job_id, tag = running_job(client)
        thread, out = held_poll(live, client, job_id, tag, wait_s=25)
        replica = make_engine(settings.resolved_database_url())  # no listener of this service on it
        try:
            with session_scope(replica) as session:
                job = session.get(Job, job_id)
                assert job is not None
                record_transition(session, job, JobState.failed, "failed on another replica's watch")
        finally:
            replica.dispose()
        thread.join(timeout=30)
    answer, took = out[0]
    assert answer.status_code == 200 and answer.json()["state"] == "failed", answer.text
    assert took < 15


@pytest.mark.parametrize("wait_s", ["-1", "31", "soon"])
def test_a_bad_wait_is_refused_by_name(live: LiveServer, wait_s: str) -> None:
    with live.client() as client:
        job_id, tag = running_job(client)
        answer = client.get(f"{JOBS}/{job_id}", params={"wait_s": wait_s}, headers={"If-None-Match": tag})
    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"] == ["query", "wait_s"]


def test_a_long_poll_on_a_job_nobody_may_see_is_a_404_at_once(live: LiveServer) -> None:
    with live.client("alice") as alice, live.client("bob") as bob:
        job_id, tag = running_job(alice)
        started = time.monotonic()
        answer = bob.get(f"{JOBS}/{job_id}", params={"wait_s": 20}, headers={"If-None-Match": tag})
        took = time.monotonic() - started
    assert answer.status_code == 404 and took < 10
    assert live.runtime.job_watch.waiters() == 0


# ---------------------------------------------------------------- JobWatch itself


def test_the_watch_wakes_only_the_waiters_of_the_changed_job() -> None:
    async def scenario() -> tuple[bool, bool, int, int]:
        watch = JobWatch(max_total=10, max_per_user=10)
        with watch.watching(1, "alice") as one, watch.watching(2, "alice") as two:
            held = watch.waiters()
            # From another thread, as the loops commit.
            threading.Thread(target=watch.changed, args=([1, 3],)).start()
            woke_one = await one.wait(5)
            woke_two = await two.wait(0.2)
        return woke_one, woke_two, held, watch.waiters()

    woke_one, woke_two, held, left = asyncio.run(scenario())
    assert (woke_one, woke_two) == (True, False)
    assert (held, left) == (2, 0)


def test_a_commit_that_stamps_jobs_tells_the_listener_which(settings: Settings) -> None:
    from service.ledger.clock import on_stamped_commit
    from service.runtime import Runtime

    runtime = Runtime.build(settings, backends={"local": FakeBackend("local")})
    heard: list[set[int]] = []
    on_stamped_commit(runtime.engine, lambda ids: heard.append(set(ids)))
    try:
        with session_scope(runtime.engine) as session:
            job = Job(name="a", owner="alice", backend="local", spec={"entrypoint": "m:f"})
            session.add(job)
            session.flush()
            job_id = job.id
        with session_scope(runtime.engine) as session:
            session.get(Job, job_id)  # a read commits nothing that is told
        with pytest.raises(RuntimeError), session_scope(runtime.engine) as session:
            found = session.get(Job, job_id)
            assert found is not None
            found.name = "rolled back"
            session.flush()
            raise RuntimeError("roll back")
    finally:
        runtime.engine.dispose()
    assert heard == [{job_id}]


def test_a_held_long_poll_does_not_hold_up_the_services_stop(settings: Settings) -> None:
    """uvicorn waits for requests in flight before the lifespan stops anything: a long poll is cut."""
    from service.api.watch import SHUTDOWN_GRACE_S
    from service.embedded import EmbeddedService

    service = EmbeddedService(settings.model_copy(update={"dev_mode": True, "port": 0}))
    service.start()
    writer = make_engine(settings.resolved_database_url())
    try:
        # An ended job, its folder counted as measured (else housekeeping's first measurement, late on
        # a busy machine, restamped it and woke the poll with 200): nothing will ever wake its poll.
        with session_scope(writer) as session:
            job = Job(
                name="done",
                owner="dev",
                backend="local",
                state=JobState.succeeded,
                spec={"entrypoint": "m:f"},
                folder_bytes=0,
            )
            session.add(job)
            session.flush()
            assert job.id is not None
            job_id = job.id
    finally:
        writer.dispose()
    client = httpx.Client(base_url=service.url, timeout=60)
    tag = client.get(f"{JOBS}/{job_id}").raise_for_status().headers["ETag"]

    def held() -> int | str:
        try:
            return long_poll(client, job_id, tag, wait_s=25)[0].status_code
        except httpx.HTTPError as error:
            return type(error).__name__

    thread, out = in_background(held)
    time.sleep(0.5)  # the poll is held by now
    started = time.monotonic()
    service.stop()
    took = time.monotonic() - started
    thread.join(timeout=30)
    client.close()
    assert took < SHUTDOWN_GRACE_S + 5, f"the stop waited {took:.1f} s for the long poll"
    assert out and out[0] != 200


def test_a_held_poll_is_a_gauge_while_held_and_its_wait_is_not_counted_as_latency(live: LiveServer) -> None:
    from tests.api.test_metrics import sample

    route = "/api/v1/jobs/{job_id}"
    with live.client() as client:
        job_id, tag = running_job(client)
        thread, out = held_poll(live, client, job_id, tag, wait_s=1.2)
        while_held = client.get("/metrics").text
        thread.join(timeout=30)
        after = client.get("/metrics").text
    assert out[0][0].status_code == 304 and out[0][1] >= 1.2
    assert sample(while_held, "torchyard_long_polls_waiting") == 1
    assert sample(after, "torchyard_long_polls_waiting") == 0
    labels = {"method": "GET", "route": route, "status": "304"}
    assert sample(after, "torchyard_http_request_duration_seconds_count", **labels) == 1
    # Held 1.2 s, answered in milliseconds of work: it lies in the half-second bucket.
    assert sample(after, "torchyard_http_request_duration_seconds_bucket", le="0.5", **labels) == 1
