"""A waiting job carries the scheduler's start estimate (from the same status query as its state),
written when it moves by a minute or more, cleared when the job starts; the CLI words it."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from fastapi.testclient import TestClient

from service.cli.render import parse_time, start_estimate
from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import get_job, submit, wait_for, wait_state


def test_a_pending_job_shows_when_the_scheduler_expects_to_start_it(
    api: TestClient, fake_slurm: FakeBackend
) -> None:
    job_id = submit(api, backend="slurm")["id"]
    wait_state(api, job_id, "pending")
    expected = datetime.now(timezone.utc).replace(microsecond=0) + timedelta(minutes=12, seconds=20)
    fake_slurm.set_status(job_id, JobState.pending, "Resources", expected_start=expected)

    waiting = wait_for(lambda: (j := get_job(api, job_id))["expected_start_at"] and j, what="an estimate")
    assert parse_time(waiting["expected_start_at"]) == expected
    assert start_estimate(waiting) == "starts in about 12 min, reason: Resources"

    # SLURM's backfill pass nudges it by seconds: not worth a write (and a restamp) per pass.
    stamp = waiting["updated_at"]
    fake_slurm.set_status(
        job_id, JobState.pending, "Resources", expected_start=expected + timedelta(seconds=20)
    )
    polled = fake_slurm.polled_ids
    wait_for(lambda: fake_slurm.polled_ids >= polled + 2, what="two more polls")
    assert get_job(api, job_id)["updated_at"] == stamp

    later = expected + timedelta(minutes=30)
    fake_slurm.set_status(job_id, JobState.pending, "Priority", expected_start=later)
    moved = wait_for(
        lambda: (j := get_job(api, job_id))["reason"] == "Priority" and j, what="the new estimate"
    )
    assert parse_time(moved["expected_start_at"]) == later

    fake_slurm.set_status(job_id, JobState.running)
    running = wait_for(lambda: (j := get_job(api, job_id))["state"] == "running" and j, what="running")
    assert running["expected_start_at"] is None and start_estimate(running) == ""


def test_a_waiting_job_cancelled_keeps_no_estimate(api: TestClient, fake_slurm: FakeBackend) -> None:
    job_id = submit(api, backend="slurm")["id"]
    wait_state(api, job_id, "pending")
    expected = datetime.now(timezone.utc) + timedelta(minutes=5)
    fake_slurm.set_status(job_id, JobState.pending, "Resources", expected_start=expected)
    wait_for(lambda: get_job(api, job_id)["expected_start_at"], what="an estimate")
    cancelled = api.post(f"/api/v1/jobs/{job_id}/cancel").json()
    assert cancelled["state"] == "cancelled" and cancelled["expected_start_at"] is None
