"""The dispatcher makes job folders after its claim has committed: a job whose folder cannot be made
fails alone, and making folders (a sweep's hundreds, a large code snapshot) holds up no other write.
Its claim takes owners in turn: one user's hundreds of queued jobs never hold another user's job back
for more than one place a round (the house's fair share, for the dispatch thread)."""

from __future__ import annotations

import errno
import threading
import time
from datetime import datetime
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.config import Settings
from service.ledger.db import write_scope
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job
from service.loops import dispatch
from service.loops.dispatch import Dispatcher
from service.states import JobState
from tests.fakes import FakeBackend

SPEC = {"entrypoint": "worker.tasks.faults:sleep", "resources": {}}


def queued(engine: Engine, settings: Settings, count: int, owner: str = "anonymous") -> list[int]:
    ids: list[int] = []
    with Session(engine) as session:
        for n in range(count):
            job = Job(name=f"{owner}{n}", owner=owner, backend="slurm", spec=SPEC)
            session.add(job)
            session.flush()
            assert job.id is not None
            job.folder = str(settings.data_dir / "jobs" / str(job.id))
            ids.append(job.id)
        session.commit()
    return ids


def state_and_claim(engine: Engine, job_id: int) -> tuple[str, str | None, str | None]:
    with Session(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        last = session.exec(
            select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id.desc())  # type: ignore[union-attr]
        ).first()
        return job.state, job.claimed_by, last.reason if last else None


def test_a_job_whose_folder_cannot_be_made_fails_and_the_rest_of_the_batch_is_submitted(
    engine: Engine, settings: Settings
) -> None:
    blocked, fine = queued(engine, settings, 2)
    planted = settings.data_dir / "jobs" / str(blocked)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_text("a file where the job's folder goes")
    fake = FakeBackend("slurm")

    Dispatcher(engine, {"slurm": fake}, settings).dispatch_once()

    state, claimed_by, reason = state_and_claim(engine, blocked)
    assert (state, claimed_by) == (JobState.failed, None)
    assert reason is not None and reason.startswith("cannot write the job folder")
    assert fake.submit_calls == [[fine]]
    assert state_and_claim(engine, fine)[:2] == (JobState.submitted, None)


def test_a_job_whose_folder_meets_a_full_disk_waits_for_a_later_tick_instead_of_failing(
    engine: Engine, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    [job_id] = queued(engine, settings, 1)
    real = dispatch.make_job_folder
    full = [True]

    def make_job_folder(*args: Any) -> None:
        if full.pop() if full else False:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(*args)

    monkeypatch.setattr(dispatch, "make_job_folder", make_job_folder)
    fake = FakeBackend("slurm")
    dispatcher = Dispatcher(engine, {"slurm": fake}, settings)

    dispatcher.dispatch_once()
    with Session(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None and (job.state, job.claimed_by) == (JobState.queued, None)
        assert (
            job.reason
            == "dispatch failed, will retry: cannot write the job folder: [Errno 28] No space left on device"
        )
    assert fake.submit_calls == []

    dispatcher.dispatch_once()  # room again
    assert state_and_claim(engine, job_id)[:2] == (JobState.submitted, None)


def test_a_write_to_a_claimed_job_is_not_held_while_its_folder_is_made(
    engine: Engine, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel, a new job's commit: on SQLite every write waited for the claim's turn to write
    (write_scope), on PostgreSQL a write to a claimed job for its row lock, while the claim made the
    folders."""
    (job_id,) = queued(engine, settings, 1)
    make_folder = dispatch.make_job_folder
    written: list[int] = []

    def touch() -> None:
        with write_scope(engine) as session:
            job = session.get(Job, job_id, with_for_update=True)
            assert job is not None
            job.reason = "touched"
            written.append(job_id)

    def make_then_write(*args: Any) -> None:
        make_folder(*args)
        writer = threading.Thread(target=touch)
        writer.start()
        writer.join(timeout=2)
        assert written == [job_id], "a write waited for the folders"

    monkeypatch.setattr(dispatch, "make_job_folder", make_then_write)
    fake = FakeBackend("slurm")

    Dispatcher(engine, {"slurm": fake}, settings).dispatch_once()

    assert fake.submit_calls == [[job_id]]
    assert state_and_claim(engine, job_id)[:2] == (JobState.submitted, None)


def test_a_claim_whose_folders_take_long_is_renewed_so_no_other_replica_takes_it_over(
    engine: Engine, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim older than CLAIM_TTL is another replica's to take over (its dispatcher looks dead):
    while a batch's folders are made, its claims are renewed every CLAIM_RENEW_S."""
    ids = queued(engine, settings, 3)
    make_folder = dispatch.make_job_folder
    seen: list[datetime] = []  # the first job's claimed_at, as each folder is made

    def slow_make(*args: Any) -> None:
        with Session(engine) as session:
            job = session.get(Job, ids[0])
            assert job is not None and job.claimed_at is not None
            seen.append(job.claimed_at)
        time.sleep(0.05)
        make_folder(*args)

    monkeypatch.setattr(dispatch, "make_job_folder", slow_make)
    monkeypatch.setattr(dispatch, "CLAIM_RENEW_S", 0.01)
    fake = FakeBackend("slurm")

    Dispatcher(engine, {"slurm": fake}, settings).dispatch_once()

    assert seen[0] < seen[1] < seen[2]
    assert fake.submit_calls == [ids]


def test_a_tick_claims_owners_in_turn(engine: Engine, settings: Settings) -> None:
    settings.dispatch_batch_size = 6
    flood = queued(engine, settings, 30, "mallory")
    alice = queued(engine, settings, 2, "alice")
    bob = queued(engine, settings, 1, "bob")
    fake = FakeBackend("slurm")

    claimed = Dispatcher(engine, {"slurm": fake}, settings).dispatch_once()

    assert claimed == 6
    [handed] = fake.submit_calls
    # Each owner's oldest first (in id order among the owners), then each one's second, ...
    assert handed == [flood[0], alice[0], bob[0], flood[1], alice[1], flood[2]]


def test_one_owner_alone_still_fills_the_batch_in_id_order(engine: Engine, settings: Settings) -> None:
    settings.dispatch_batch_size = 4
    jobs = queued(engine, settings, 10, "alice")
    fake = FakeBackend("slurm")

    Dispatcher(engine, {"slurm": fake}, settings).dispatch_once()

    assert fake.submit_calls == [jobs[:4]]
