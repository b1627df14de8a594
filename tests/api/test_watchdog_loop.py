"""The watchdog inside the reconcile loop (service.loops.watch), on a scripted backend: a job whose
ranks' activity stands still past its threshold is flagged (after the tick, with a capture), cleared
when it reports again; on_stall "fail" ends the attempt as hang and stops the run; a fault of the
watchdog's own costs no job anything."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.domain import capture
from tests.fakes import FakeBackend
from tests.support import JOBS, authorize, get_job, login_headers, runtime_of, wait_for, wait_state
from worker.spec import JobFiles

LATER_S = 100.0  # how far the watchdog's clock is moved on: past the threshold below
WATCH = {"stall_after_s": 30}


@contextmanager
def quiet_service(settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend) -> Iterator[TestClient]:
    """The service with reconcile loops that never tick on their own: the test drives each tick."""
    fake.poll_interval_s = fake_slurm.poll_interval_s = 3600.0
    settings = settings.model_copy(update={"ending_files_grace_s": 0.0})  # each tick decides what it sees
    with TestClient(create_app(settings, backends={"local": fake, "slurm": fake_slurm})) as client:
        fake.set_wakeup(lambda: None)
        yield authorize(client)


@pytest.fixture
def quiet_api(settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend) -> Iterator[TestClient]:
    with quiet_service(settings, fake, fake_slurm) as client:
        yield client


def tick(api: TestClient) -> None:
    runtime_of(api).reconciler.reconcile_once("local")


def running(api: TestClient, headers: dict[str, str] | None = None, **fields: Any) -> int:
    body = {"name": "watched", "entrypoint": "worker.tasks.seed:ddp_step", "watchdog": WATCH, **fields}
    response = api.post(JOBS, json=body, headers=headers)
    assert response.status_code == 201, response.text
    job_id = int(response.json()["id"])
    wait_state(api, job_id, "submitted", headers=headers)
    tick(api)
    assert get_job(api, job_id, headers)["state"] == "running"
    return job_id


def stand_still(fake: FakeBackend, job_id: int, where: str = "job.py:5 stuck") -> None:
    """Rank 0's activity file: sampled just now, unchanged since long before."""
    files: JobFiles = fake.specs[job_id].files
    files.activity(0).parent.mkdir(parents=True, exist_ok=True)
    now = time.time() + LATER_S
    record = {"attempt": 1, "rank": 0, "host": "n1", "pid": 1, "time": now, "changed_at": now - 60,
              "where": where}  # fmt: skip
    files.activity(0).write_text(json.dumps(record))


def later(api: TestClient, seconds: float) -> None:
    watch = runtime_of(api).reconciler.watch
    watch.clock = lambda: time.time() + seconds
    watch._checked.clear()  # judged again at once


def test_a_job_standing_still_is_flagged_with_a_capture_and_cleared_when_it_reports(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    job_id = running(quiet_api)
    stand_still(fake, job_id)
    later(quiet_api, LATER_S)
    tick(quiet_api)

    flagged = wait_for(lambda: (j := get_job(quiet_api, job_id))["stalled_at"] and j, 10, "the flag")
    assert flagged["state"] == "running"
    assert flagged["stall_reason"].startswith("no progress for ")
    assert "threshold 30 s" in flagged["stall_reason"]
    assert [call.external_id for call in fake.stack_calls] == [fake.external_id(job_id)]  # captured
    assert runtime_of(quiet_api).reconciler.watch.stalls_total == 1

    report = {"step": 1, "attempt": 1, "time": time.time()}
    fake.specs[job_id].files.progress.write_text(json.dumps(report) + "\n")
    later(quiet_api, 0)
    tick(quiet_api)

    cleared = get_job(quiet_api, job_id)
    assert cleared["stalled_at"] is None and cleared["stall_reason"] is None
    events = [e["reason"] or "" for e in quiet_api.get(f"{JOBS}/{job_id}/events").json()]
    assert events[-2] == f"stalled: {flagged['stall_reason']}"
    assert events[-1].startswith("progress resumed after a stall of ")


def test_on_stall_fail_ends_the_attempt_as_hang_and_stops_the_run(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    # No restarts in place: by default a hang is restarted in place (tests/api/test_restarts.py).
    job_id = running(
        quiet_api, watchdog={**WATCH, "on_stall": "fail"}, retries={"max": 0}, restarts={"max": 0}
    )
    stand_still(fake, job_id)
    later(quiet_api, LATER_S)
    tick(quiet_api)

    ended = wait_state(quiet_api, job_id, "failed")
    attempt = quiet_api.get(f"{JOBS}/{job_id}/attempts").json()[0]
    assert attempt["kind"] == "hang" and attempt["reason"].startswith("stalled: no progress for ")
    assert ended["stalled_at"] is None
    tick(quiet_api)
    assert [fake.external_id(job_id)] in fake.cancel_calls  # the run stopped


def test_a_fault_of_the_watchdog_costs_no_job_anything(
    quiet_api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = running(quiet_api)
    reconciler = runtime_of(quiet_api).reconciler

    def broken(*_: object) -> None:
        raise RuntimeError("the watchdog broke")

    monkeypatch.setattr(reconciler.watch, "check", broken)
    fake.specs[job_id].files.progress.write_text(json.dumps({"step": 3, "attempt": 1}) + "\n")
    for _ in range(4):  # more than a bulkhead's FAIL_AFTER
        tick(quiet_api)

    job = get_job(quiet_api, job_id)
    assert job["state"] == "running" and job["progress"]["step"] == 3
    assert "broke" not in (job["reason"] or "")
    assert reconciler.watch_bulkhead.faults_total == 4


def test_one_users_stalling_jobs_do_not_delay_another_users_stall_past_one_capture(
    settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 43, finding 7: the captures at stalls are served owners in turn. Ranks that ignore the
    signal make each capture last WAIT_S (1 s here); alice's 8 stalling jobs are queued before bob's
    one with on_stall "fail" on 2 capture threads. In turn, bob's capture waits for one of alice's
    under way to end (up to WAIT_S); first come first served, it waited four rounds of them (4 s).
    The bound sits between the two, with room for a loaded machine."""
    monkeypatch.setattr(capture, "WAIT_S", 1.0)
    two = settings.model_copy(update={"capture_threads": 2})
    with quiet_service(two, fake, fake_slurm) as api:
        bob = login_headers(api.app, "bob")
        quiet = time_to_fail(api, fake, running(api, headers=bob, **FAIL), bob)
        later(api, 0)
        alices = [running(api) for _ in range(8)]
        for job_id in alices:
            stand_still(fake, job_id)
        busy = time_to_fail(api, fake, running(api, headers=bob, **FAIL), bob)

        assert busy < quiet + 2.5 * capture.WAIT_S, (quiet, busy)  # before: about 4 captures more
        flagged = lambda: all(get_job(api, job_id)["stalled_at"] for job_id in alices)  # noqa: E731
        wait_for(flagged, 20, "alice's stalls flagged too")


FAIL = {"watchdog": {**WATCH, "on_stall": "fail"}, "retries": {"max": 0}, "restarts": {"max": 0}}


def time_to_fail(api: TestClient, fake: FakeBackend, job_id: int, headers: dict[str, str]) -> float:
    """How long from the tick that finds `job_id` stalled until it has failed as hang."""
    stand_still(fake, job_id)
    later(api, LATER_S)
    started = time.monotonic()
    tick(api)
    wait_state(api, job_id, "failed", timeout=30, headers=headers)
    return time.monotonic() - started
