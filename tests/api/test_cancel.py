"""POST /api/v1/jobs/{id}/cancel: works in every non-terminal state and is idempotent."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import col, select

from service.errors import BackendError
from service.ledger.db import is_sqlite, writer_turn
from service.ledger.models.jobs import Job
from tests.fakes import FakeBackend
from tests.support import JOBS, get_job, runtime_of, submit, wait_for, wait_state


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


def row_is_free_and_flagged(engine: Engine, job_id: int) -> bool:
    """From a connection of its own, without waiting: the job's row can be locked now, and the cancel
    request is already committed (another connection sees only committed rows)."""
    # On SQLite, this process's writers take turns (writer_turn): the loops cannot be mid-write while
    # this looks, and the turn is re-entrant, so a cancel that still held a write would show here.
    with writer_turn(engine), engine.connect() as connection:
        query = select(col(Job.cancel_requested)).where(col(Job.id) == job_id)
        if is_sqlite(str(engine.url)):  # one writer at a time: can a write transaction begin now?
            connection.exec_driver_sql("PRAGMA busy_timeout=0")
            connection.exec_driver_sql("BEGIN IMMEDIATE")
        else:  # row locks: is this one free?
            connection.exec_driver_sql("SET lock_timeout = '100ms'")
            query = query.with_for_update(nowait=True)
        flagged = bool(connection.execute(query).scalar_one())
        connection.rollback()
    return flagged


def test_the_scheduler_is_told_to_cancel_with_no_lock_held_on_the_job(
    api: TestClient, fake: FakeBackend
) -> None:
    engine = runtime_of(api).engine
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")
    seen: list[bool] = []
    real_cancel = fake.cancel

    def cancel_and_look(external_ids: Sequence[str]) -> None:
        seen.append(row_is_free_and_flagged(engine, job_id))  # raises if the row (or SQLite) is locked
        real_cancel(external_ids)

    fake.cancel = cancel_and_look  # type: ignore[method-assign]

    assert cancel(api, job_id)["state"] == "cancelled"
    assert seen == [True]
    assert cancelled_events(api, job_id) == 1


def test_a_cancel_the_scheduler_refuses_leaves_the_job_running_and_can_be_retried(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")
    real_cancel = fake.cancel

    def scheduler_down(external_ids: Sequence[str]) -> None:
        raise BackendError("scancel: Unable to contact slurm controller")

    fake.cancel = scheduler_down  # type: ignore[method-assign]
    refused = api.post(f"{JOBS}/{job_id}/cancel")
    assert refused.status_code == 502 and "scancel" in refused.text
    job = get_job(api, job_id)
    assert job["state"] == "running" and job["cancel_requested"] is True

    fake.cancel = real_cancel  # type: ignore[method-assign]
    assert cancel(api, job_id)["state"] == "cancelled"
    assert cancelled_events(api, job_id) == 1


def test_a_cancel_the_reconciler_sees_first_still_reads_cancelled_by_user(
    api: TestClient, fake: FakeBackend
) -> None:
    """The scheduler's word that the job was cancelled can reach a reconcile tick between the cancel's
    call to the scheduler and its own transition (under load, often). The reason must not depend on
    which writes first: pipelines recognise a user's cancel by it."""
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")
    real_cancel = fake.cancel

    def cancel_then_tick(external_ids: Sequence[str]) -> None:
        real_cancel(external_ids)
        runtime_of(api).reconciler.reconcile_once("local")  # the tick that comes first

    fake.cancel = cancel_then_tick  # type: ignore[method-assign]

    ended = cancel(api, job_id)

    assert (ended["state"], ended["reason"]) == ("cancelled", "cancelled by user")
    assert get_job(api, job_id)["reason"] == "cancelled by user"
    assert cancelled_events(api, job_id) == 1
