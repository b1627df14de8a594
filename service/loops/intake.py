"""Group commit for new jobs: many POSTs, one transaction (admission's `Store`, service.domain.storing).

SQLite allows one writer at a time; a transaction per request makes requests queue on the write lock
and the slowest wait for all the others. One writer thread drains whatever arrived meanwhile and commits it
together, so each request waits for at most one commit. The commit is where an Idempotency-Key is
settled for good (the jobs its keys made are read there, `replay_reads`, and a key another replica
stored meanwhile makes the batch look again) and where each owner's unfinished jobs are counted.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import String, Table, cast, insert, literal, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.domain.auth import Principal
from service.domain.dependencies import dependency_rows, insert_dependencies
from service.domain.job_request import new_job_values
from service.domain.notifications import subscribe_new_jobs
from service.domain.quotas import UnfinishedCount
from service.domain.storing import (
    Accepted,
    Key,
    SweepAccepted,
    replay,
    replay_reads,
    replay_sweep,
    replays_found,
)
from service.domain.sweeps import just_made
from service.domain.transitions import record_accepted
from service.errors import Conflict
from service.ledger.db import write_scope
from service.ledger.models.access import AuditEntry
from service.ledger.models.jobs import Job, JobPublic, NewJob
from service.ledger.models.pipelines import NewPipeline, PipelineAccepted
from service.ledger.models.sweeps import NewSweep, Sweep
from service.ledger.sql import id_conditions
from service.loops.pipeline_store import store_pipeline, store_retry
from service.states import JobState

log = logging.getLogger(__name__)

MAX_BATCH = 500
T = TypeVar("T")

# Core tables: the writer inserts a batch as a few multi-row statements, not one ORM object a row.
_JOBS: Table = Job.__table__  # type: ignore[attr-defined]
_AUDIT: Table = AuditEntry.__table__  # type: ignore[attr-defined]

Outcome = Accepted | SweepAccepted


@dataclass
class _Pending:
    row: NewJob | NewSweep  # one job, or a sweep with all its trials (stored whole or not at all)
    max_active: int | None  # the owner's limit on unfinished jobs, checked in the commit
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Outcome]


class JobIntake:
    """Writes new Job rows (with their first event) in batches; `add` resolves once committed.

    A job's folder is `<jobs_root>/<id>`, set in the same transaction once the id is known."""

    def __init__(self, engine: Engine, jobs_root: str, on_commit: Callable[[], None]) -> None:
        self._engine = engine
        self._folder_prefix = jobs_root.rstrip("/") + "/"
        self._on_commit = on_commit
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="torchyard-intake", daemon=True)
        self.batches_committed = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    async def add(self, row: NewJob, max_active: int | None = None) -> Accepted:
        """Store `row`, or find the job an earlier request with the same (owner, idempotency key) made.

        `max_active`: the owner may have at most this many unfinished jobs. They are counted in the
        transaction that stores the row, under a lock per owner, so replicas sharing one ledger cannot
        together admit more (RetryLater when the row would be one too many)."""
        outcome = await self._enqueue(row, max_active)
        assert isinstance(outcome, Accepted)
        return outcome

    async def add_sweep(self, sweep: NewSweep, max_active: int | None = None) -> SweepAccepted:
        """Store a sweep and all its trials in one transaction, or none of them: refused whole when
        the trials would take the owner past `max_active`. An Idempotency-Key makes the sweep once."""
        outcome = await self._enqueue(sweep, max_active)
        assert isinstance(outcome, SweepAccepted)
        return outcome

    async def add_pipeline(self, pipeline: NewPipeline, max_active: int | None = None) -> PipelineAccepted:
        """Store a pipeline, its stages and all their jobs and sweeps in one transaction, or none of
        them (service.loops.pipeline_store). A pipeline is rare and large: it gets a transaction of
        its own, in a worker thread, taking its turn with the intake's batches (write_scope)."""
        return await asyncio.to_thread(
            self._committed,
            functools.partial(store_pipeline, pipeline=pipeline, max_active=max_active,
                              insert_jobs=self._insert, insert_sweep=self._insert_sweep),
        )  # fmt: skip

    async def retry_pipeline(
        self, pipeline_id: int, start: str, viewer: Principal, max_active: int | None = None
    ) -> None:
        """A `retry --from start`'s new jobs, in one transaction (service.loops.pipeline_store)."""
        await asyncio.to_thread(
            self._committed,
            functools.partial(store_retry, pipeline_id=pipeline_id, start=start, viewer=viewer,
                              max_active=max_active, insert_jobs=self._insert,
                              insert_sweep=self._insert_sweep),
        )  # fmt: skip

    def _committed(self, work: Callable[[Session], T]) -> T:
        try:
            with write_scope(self._engine) as session:
                done = work(session)
        except IntegrityError:  # another replica stored this Idempotency-Key since we looked: look again
            with write_scope(self._engine) as session:
                done = work(session)
        self._on_commit()
        return done

    def _insert_sweep(self, session: Session, sweep: NewSweep) -> SweepAccepted:
        stored = self._store_sweep(session, sweep, None, {}, UnfinishedCount(session, set()))
        assert isinstance(stored, SweepAccepted), "no key and no limit: stored"
        return stored

    async def _enqueue(self, row: NewJob | NewSweep, max_active: int | None) -> Outcome:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        self._queue.put(_Pending(row=row, max_active=max_active, loop=loop, future=future))
        return await future

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[_Pending]) -> None:
        try:
            try:
                outcomes = self._store(batch)
            except IntegrityError:  # another replica stored one of these keys since we looked: look again
                outcomes = self._store(batch)
        except Exception as error:  # the whole batch failed: every waiter hears it, nothing half-written
            log.warning("could not store %d new jobs: %s", len(batch), error)
            for item in batch:
                item.loop.call_soon_threadsafe(_set_exception, item.future, error)
            return
        self.batches_committed += 1
        # One wake-up per event loop for the whole batch, not one per waiter.
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Pending, Outcome | Exception]]] = {}
        for item, outcome in zip(batch, outcomes, strict=True):
            by_loop.setdefault(item.loop, []).append((item, outcome))
        for loop, answers in by_loop.items():
            loop.call_soon_threadsafe(_answer_all, answers)
        self._on_commit()

    def _store(self, batch: list[_Pending]) -> list[Outcome | Exception]:
        with write_scope(self._engine) as session:
            jobs = [item for item in batch if isinstance(item.row, NewJob)]
            sweeps = [item for item in batch if isinstance(item.row, NewSweep)]
            earlier = _jobs_by_key(session, [item.row for item in jobs if isinstance(item.row, NewJob)])
            earlier_sweeps = _sweeps_by_key(
                session, [item.row for item in sweeps if isinstance(item.row, NewSweep)]
            )
            room = UnfinishedCount(session, {item.row.owner for item in batch if item.max_active is not None})
            outcomes: dict[int, Outcome | Exception] = {}
            # Sweeps first: their trials need the sweep's id, and join the batch's insert below.
            for item in sweeps:
                assert isinstance(item.row, NewSweep)
                outcomes[id(item)] = self._store_sweep(
                    session, item.row, item.max_active, earlier_sweeps, room
                )
            fresh: list[NewJob] = []
            first_in_batch: dict[Key, int] = {}  # a retry in this same batch answers with that job
            # Per row: an index into fresh, (the key of the earlier job, row), or why it was refused.
            slots: list[int | tuple[Key, NewJob] | Exception] = []
            for item in jobs:
                row = item.row
                assert isinstance(row, NewJob)
                key = (row.owner, row.idempotency_key) if row.idempotency_key is not None else None
                if key is not None and (key in earlier or key in first_in_batch):
                    slots.append((key, row))
                    continue
                if item.max_active is not None:
                    refusal = room.take(row.owner, item.max_active)
                    if refusal is not None:
                        slots.append(refusal)
                        continue
                if key is not None:
                    first_in_batch[key] = len(fresh)
                slots.append(len(fresh))
                fresh.append(row)
            stored = self._insert(session, fresh)
            for key, index in first_in_batch.items():
                earlier[key] = stored[index]
            for item, slot in zip(jobs, slots, strict=True):
                outcomes[id(item)] = (
                    Accepted(stored[slot], replayed=False)
                    if isinstance(slot, int)
                    else slot
                    if isinstance(slot, Exception)
                    else _replay(earlier[slot[0]], slot[1])
                )
        return [outcomes[id(item)] for item in batch]

    def _store_sweep(
        self,
        session: Session,
        sweep: NewSweep,
        max_active: int | None,
        earlier: dict[Key, Sweep],
        room: UnfinishedCount,
    ) -> Outcome | Exception:
        """The sweep row and its trials, in this transaction; a retry with its key answers the first."""
        key = (sweep.owner, sweep.idempotency_key) if sweep.idempotency_key is not None else None
        if key is not None and key in earlier:
            try:
                return replay_sweep(earlier[key], sweep.request)
            except Conflict as conflict:
                return conflict
        if max_active is not None:
            refusal = room.take(sweep.owner, max_active, len(sweep.trials))
            if refusal is not None:
                return refusal
        row = Sweep(
            name=sweep.name,
            owner=sweep.owner,
            backend=sweep.backend,
            request=sweep.request,
            size=len(sweep.trials),
            search_trials=sweep.search_trials,
            max_parallel=sweep.max_parallel,
            metric=sweep.metric,
            goal=sweep.goal,
            idempotency_key=sweep.idempotency_key,
            created_at=sweep.created_at,
        )
        session.add(row)
        session.flush()
        assert row.id is not None
        if key is not None:
            earlier[key] = row
        trials = self._insert(session, sweep.trials, sweep_id=row.id)
        return SweepAccepted(row.id, replayed=False, made=just_made(row, trials))

    def insert_trials(self, session: Session, fresh: Sequence[NewJob], sweep_id: int) -> list[JobPublic]:
        """A search's later trials, in the caller's transaction (service.loops.sweep_search): stored as
        the first wave was."""
        return self._insert(session, fresh, sweep_id=sweep_id)

    def _insert(
        self, session: Session, fresh: Sequence[NewJob], sweep_id: int | None = None
    ) -> list[JobPublic]:
        """The rows, their "accepted" events and audit entries: a few statements for the whole batch."""
        if not fresh:
            return []
        connection = session.connection()
        values = [new_job_values(row, sweep_id) for row in fresh]
        ids = _inserted_ids(connection, values)
        for condition in id_conditions(_JOBS.c.id, ids):
            connection.execute(
                update(_JOBS)
                .where(condition)
                .values(folder=literal(self._folder_prefix) + cast(_JOBS.c.id, String))
            )
        connection.execute(
            insert(_AUDIT),
            [
                {"time": row.created_at, "actor": row.owner, "action": "job.submit",
                 "target": f"job {job_id}", "detail": f"name={row.name}"}
                for job_id, row in zip(ids, fresh, strict=True)
            ],
        )  # fmt: skip
        insert_dependencies(
            session,
            [
                dependency
                for job_id, row in zip(ids, fresh, strict=True)
                for dependency in dependency_rows(job_id, row.after)
            ],
        )
        subscribe_new_jobs(
            session, [(job_id, row.owner, row.notify) for job_id, row in zip(ids, fresh, strict=True)]
        )
        stamp = record_accepted(
            session,
            [
                (job_id, row.created_at, JobState(value["state"]), value["reason"])
                for job_id, row, value in zip(ids, fresh, values, strict=True)
            ],
        )
        return [
            JobPublic.model_validate(
                {**value, "id": job_id, "folder": f"{self._folder_prefix}{job_id}", "updated_at": stamp}
            )
            for job_id, value in zip(ids, values, strict=True)
        ]


def _inserted_ids(connection: Connection, values: list[dict[str, Any]]) -> list[int]:
    """Insert these jobs; their ids, in the order of `values`.

    SQLAlchemy keeps RETURNING in parameter order on PostgreSQL within multi-row INSERTs, but on
    SQLite (whose RETURNING order is unspecified) only by one INSERT per row: 200 statements for a
    sweep of 200 trials, most of its commit. SQLite gives a multi-row INSERT's rows increasing ids in
    VALUES order, under its one write lock, so there the ids sorted are the rows' ids in order."""
    if connection.dialect.name == "sqlite":
        inserted = connection.execute(insert(_JOBS).returning(_JOBS.c.id), values)
        return sorted(int(job_id) for job_id in inserted.scalars())
    inserted = connection.execute(insert(_JOBS).returning(_JOBS.c.id, sort_by_parameter_order=True), values)
    return [int(job_id) for job_id in inserted.scalars()]


def _jobs_by_key(session: Session, rows: list[NewJob]) -> dict[Key, JobPublic]:
    """The jobs earlier requests with these rows' keys made (service.domain.storing's one read)."""
    keys = [(row.owner, row.idempotency_key) for row in rows if row.idempotency_key is not None]
    found: dict[Key, JobPublic] = {}
    for statement, values in replay_reads(keys):
        found.update(replays_found(session.connection().execute(statement, values)))
    return found


def _sweeps_by_key(session: Session, rows: list[NewSweep]) -> dict[Key, Sweep]:
    """The sweeps earlier requests with these rows' keys made."""
    keys = {row.idempotency_key for row in rows if row.idempotency_key is not None}
    if not keys:
        return {}
    owners = {row.owner for row in rows}
    query = select(Sweep).where(col(Sweep.idempotency_key).in_(keys), col(Sweep.owner).in_(owners))
    return {(one.owner, one.idempotency_key): one for one in session.exec(query) if one.idempotency_key}


def _replay(earlier: JobPublic, row: NewJob) -> Accepted | Exception:
    try:
        return replay(earlier, row)
    except Exception as error:
        return error


def _answer_all(answers: list[tuple[_Pending, Outcome | Exception]]) -> None:
    for item, outcome in answers:
        if isinstance(outcome, Exception):
            _set_exception(item.future, outcome)
        else:
            _set_result(item.future, outcome)


def _set_result(future: asyncio.Future[Outcome], value: Outcome) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Outcome], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
