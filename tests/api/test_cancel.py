"""POST /api/v1/jobs/{id}/cancel: works in every non-terminal state and is idempotent."""

from __future__ import annotations

import time
from typing import Any

from fastapi.testclient import TestClient

from tests.fakes import FakeBackend
from tests.support import JOBS, get_job, submit, wait_for, wait_state


def cancel(api: TestClient, job_id: int) -> dict[str, Any]:
    response = api.post(f"{JOBS}/{job_id}/cancel")
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


def cancelled_events(api: TestClient, job_id: int) -> int:
    events = api.get(f"{JOBS}/{job_id}/events").json()
    return sum(1 for event in events if event["to_state"] == "cancelled")


def test_cancel_a_queued_job_twice(api: TestClient, fake: FakeBackend) -> None:
    fake.submit_error = "scheduler down"  # the job cannot leave the queue
    job_id = submit(api)["id"]
    wait_for(lambda: fake.submit_calls, what="a dispatch attempt")

    first = cancel(api, job_id)
    assert first["cancel_requested"] is True
    assert first["state"] in ("queued", "cancelled")  # a dispatcher holding it finishes the cancel
    job = wait_state(api, job_id, "cancelled")
    second = cancel(api, job_id)

    assert second["state"] == "cancelled"
    assert second["finished_at"] == job["finished_at"]
    assert cancelled_events(api, job_id) == 1
    fake.submit_error = None
    time.sleep(0.2)  # several dispatch intervals: a cancelled job is never submitted
    assert job_id not in fake.specs
    assert fake.cancel_calls == []  # the backend never had it
    assert get_job(api, job_id)["state"] == "cancelled"


def test_cancel_a_running_job_twice(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")

    first = cancel(api, job_id)
    second = cancel(api, job_id)

    assert first["state"] == "cancelled" and first["finished_at"] is not None
    assert first["reason"] == "cancelled by user"
    assert second["state"] == "cancelled"
    assert fake.cancel_calls == [[fake.external_id(job_id)]]  # once, not once per request
    assert cancelled_events(api, job_id) == 1
    time.sleep(0.2)  # reconcile ticks must not bring it back
    assert get_job(api, job_id)["state"] == "cancelled"


def test_cancel_a_pending_job(api: TestClient, fake_slurm: FakeBackend) -> None:
    job_id = submit(api, backend="slurm")["id"]
    wait_state(api, job_id, "pending")

    assert cancel(api, job_id)["state"] == "cancelled"
    assert fake_slurm.cancel_calls == [[fake_slurm.external_id(job_id)]]


def test_cancel_of_a_finished_job_changes_nothing(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")
    fake.finish(job_id, "done")
    done = wait_state(api, job_id, "succeeded")

    after = cancel(api, job_id)

    assert after["state"] == "succeeded" and after["result"] == "done"
    assert after["finished_at"] == done["finished_at"]
    assert fake.cancel_calls == []
