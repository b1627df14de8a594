"""Group commit: many concurrent POSTs become few transactions; a failing batch writes nothing;
a retry with an Idempotency-Key is answered with the first job, in the same batch or a later one."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import StatementError
from sqlmodel import Session, func, select

from service.domain.quotas import RetryLater
from service.errors import Conflict
from service.ledger.db import make_engine
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job, JobPublic, NewJob
from service.loops.intake import MAX_BATCH, Accepted, JobIntake
from service.states import JobState
from tests.support import run_async

T = TypeVar("T")


class Commits:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


def make_intake(engine: Engine, commits: Commits) -> JobIntake:
    return JobIntake(engine, "/data/jobs", commits)


def row(n: int, key: str | None = None, owner: str = "alice") -> NewJob:
    return NewJob(
        name=f"job-{n}", owner=owner, backend="local", spec={"entrypoint": "a.b:c"}, idempotency_key=key
    )


def counts(engine: Engine) -> tuple[int, int]:
    with Session(engine) as session:
        jobs = session.exec(select(func.count()).select_from(Job)).one()
        events = session.exec(select(func.count()).select_from(JobEvent)).one()
    return int(jobs), int(events)


async def add_all(intake: JobIntake, rows: list[NewJob], *, start: bool) -> list[JobPublic | BaseException]:
    """Queue every add; with start=True only now start the writer, so they all wait together."""

    async def add(row: NewJob) -> JobPublic:
        return (await intake.add(row)).job

    tasks = [asyncio.create_task(add(r)) for r in rows]
    await asyncio.sleep(0)  # every task has put its row on the queue
    if start:
        intake.start()
    return await asyncio.gather(*tasks, return_exceptions=True)


def test_waiting_adds_are_written_in_batches_of_at_most_max_batch(engine: Engine) -> None:
    commits = Commits()
    intake = make_intake(engine, commits)
    rows = [row(n) for n in range(2 * MAX_BATCH + 200)]
    try:
        results = run_async(add_all(intake, rows, start=True))
    finally:
        intake.stop()

    published = [r for r in results if isinstance(r, JobPublic)]
    assert len(published) == len(rows)
    assert intake.batches_committed == 3 and commits.count == 3
    assert sorted(p.id for p in published) == list(range(1, len(rows) + 1))
    assert [p.name for p in published] == [r.name for r in rows]  # each waiter gets its own job
    with Session(engine) as session:  # ... and the id it is told is that job's row
        stored = dict(session.exec(select(Job.id, Job.name)).all())
    assert {p.id: p.name for p in published} == stored
    assert all(p.folder == f"/data/jobs/{p.id}" for p in published)
    assert counts(engine) == (len(rows), len(rows))  # every job with its "accepted" event


def test_many_concurrent_adds_need_few_commits(engine: Engine) -> None:
    intake = make_intake(engine, Commits())
    intake.start()
    try:
        results = run_async(add_all(intake, [row(n) for n in range(300)], start=False))
    finally:
        intake.stop()

    assert all(isinstance(r, JobPublic) for r in results)
    assert intake.batches_committed <= 10  # not 300
    assert counts(engine) == (300, 300)


def test_a_failing_batch_rejects_every_waiter_and_writes_nothing(engine: Engine) -> None:
    commits = Commits()
    intake = make_intake(engine, commits)
    # A spec JSON cannot hold (a set) makes the whole batch's flush fail.
    bad = NewJob(name="bad", owner="alice", backend="local", spec={"entrypoint": "a.b:c", "kwargs": {1, 2}})
    rows = [row(0), row(1), bad, row(3), row(4)]
    try:
        results = run_async(add_all(intake, rows, start=True))
        assert counts(engine) == (0, 0)
        assert intake.batches_committed == 0 and commits.count == 0
        assert all(isinstance(r, StatementError) for r in results), results

        # The writer survives and takes the next batch.
        [after] = run_async(add_all(intake, [row(5)], start=False))
    finally:
        intake.stop()

    assert isinstance(after, JobPublic) and after.name == "job-5"
    assert counts(engine) == (1, 1)


def accepted_all(intake: JobIntake, rows: list[NewJob]) -> list[Accepted]:
    async def gather() -> list[Accepted]:
        return await asyncio.gather(*(intake.add(r) for r in rows))

    return run_async(gather())


def test_one_key_twice_in_one_batch_makes_one_job(engine: Engine) -> None:
    intake = make_intake(engine, Commits())
    rows = [row(0), row(1, key="same"), row(1, key="same"), row(2)]
    intake.start()
    try:
        first, keyed, retried, last = accepted_all(intake, rows)
    finally:
        intake.stop()

    assert keyed.job.id == retried.job.id and (keyed.replayed, retried.replayed) == (False, True)
    assert not first.replayed and not last.replayed
    assert counts(engine) == (3, 3)


def test_a_key_used_before_answers_with_the_first_job_and_another_user_may_reuse_it(engine: Engine) -> None:
    intake = make_intake(engine, Commits())
    intake.start()
    try:
        [original] = accepted_all(intake, [row(0, key="k")])
        [again] = accepted_all(intake, [row(0, key="k")])
        [bobs] = accepted_all(intake, [row(0, key="k", owner="bob")])
    finally:
        intake.stop()

    assert again.replayed and again.job.id == original.job.id
    assert not bobs.replayed and bobs.job.id != original.job.id
    assert counts(engine) == (2, 2)


def test_a_key_reused_for_a_different_request_is_a_conflict(engine: Engine) -> None:
    intake = make_intake(engine, Commits())
    intake.start()
    try:
        accepted_all(intake, [row(0, key="k")])

        async def add_different() -> BaseException | Accepted:
            results = await asyncio.gather(intake.add(row(9, key="k")), return_exceptions=True)
            return results[0]

        outcome = run_async(add_different())
    finally:
        intake.stop()

    assert isinstance(outcome, Conflict) and "different request" in outcome.message
    assert counts(engine) == (1, 1)


# ---------------------------------------------------------------- the unfinished-jobs limit


def test_the_limit_on_unfinished_jobs_holds_across_two_replicas_writers(
    database_url: str, engine: Engine
) -> None:
    """Two intakes on two engines (two replicas' writers on one ledger), 15 rows of alice racing with
    room for 5: exactly 5 stored, the rest refused with the count; bob's row is not alice's limit."""
    other = make_engine(database_url)
    intakes = [make_intake(engine, Commits()), make_intake(other, Commits())]

    async def race() -> list[Accepted | BaseException]:
        adds = [intakes[n % 2].add(row(n), max_active=5) for n in range(15)]
        adds.append(intakes[0].add(row(99, owner="bob"), max_active=5))
        return await asyncio.gather(*adds, return_exceptions=True)

    for intake in intakes:
        intake.start()
    try:
        outcomes = run_async(race())
    finally:
        for intake in intakes:
            intake.stop()
        other.dispose()

    stored = [o for o in outcomes[:15] if isinstance(o, Accepted)]
    refused = [o for o in outcomes[:15] if isinstance(o, RetryLater)]
    assert (len(stored), len(refused)) == (5, 10), outcomes
    assert all("your limit is 5" in r.message for r in refused)
    assert isinstance(outcomes[15], Accepted)
    assert counts(engine) == (6, 6)


def test_finished_jobs_do_not_count_against_the_limit(engine: Engine) -> None:
    intake = make_intake(engine, Commits())
    intake.start()
    try:
        first = run_async(intake.add(row(0), max_active=1))

        async def one_more() -> list[Accepted | BaseException]:
            return list(await asyncio.gather(intake.add(row(1), max_active=1), return_exceptions=True))

        refused = run_async(one_more())
        with Session(engine) as session:
            job = session.get(Job, first.job.id)
            assert job is not None
            job.state = JobState.succeeded
            session.add(job)
            session.commit()
        later = run_async(intake.add(row(2), max_active=1))
    finally:
        intake.stop()

    assert isinstance(refused[0], RetryLater)
    assert later.job.name == "job-2"


def test_a_batch_from_many_owners_takes_no_more_statements_than_one_from_one_owner(engine: Engine) -> None:
    """Every owner of a batch is locked and counted at once: a lock and a count for each took half of
    a commit's round trips under 32 users submitting (tests/integration/test_load.py, PostgreSQL)."""

    def statements_to_store(rows: list[NewJob]) -> int:
        statements: list[str] = []

        def note(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
            statements.append(statement)

        intake = make_intake(engine, Commits())

        async def one_batch() -> list[Accepted]:
            adds = [asyncio.create_task(intake.add(r, max_active=5)) for r in rows]
            await asyncio.sleep(0)  # every row is queued before the writer starts: one batch
            intake.start()
            return await asyncio.gather(*adds)

        event.listen(engine, "before_cursor_execute", note)
        try:
            stored = run_async(one_batch())
        finally:
            intake.stop()
            event.remove(engine, "before_cursor_execute", note)
        assert len(stored) == len(rows) and intake.batches_committed == 1
        return len(statements)

    one_owner = statements_to_store([row(n, owner="alice") for n in range(5)])
    many_owners = statements_to_store([row(n, owner=f"user{n}") for n in range(5, 25)])
    assert many_owners == one_owner
