"""Group commit for new jobs: many POSTs, one transaction.

SQLite allows one writer at a time; a transaction per request makes requests queue on the write lock
(p99 near a second at 32 clients). One writer thread drains whatever arrived meanwhile and commits it
together, so each request waits for at most one commit.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.db import session_scope
from service.jobs import check_same_request
from service.models import AuditEntry, Job, JobEvent, JobPublic

log = logging.getLogger(__name__)

MAX_BATCH = 500


@dataclass(frozen=True)
class Accepted:
    job: JobPublic
    replayed: bool  # True: an Idempotency-Key retry, answered with the job the first request made


@dataclass
class _Pending:
    row: Job
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Accepted]


class JobIntake:
    """Writes new Job rows (with their first event) in batches; `add` resolves once committed."""

    def __init__(
        self, engine: Engine, folder_for: Callable[[int], str], on_commit: Callable[[], None]
    ) -> None:
        self._engine = engine
        self._folder_for = folder_for
        self._on_commit = on_commit
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="torchyard-intake", daemon=True)
        self.batches_committed = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    async def add(self, row: Job) -> Accepted:
        """Store `row`, or find the job an earlier request with the same (owner, idempotency key) made."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Accepted] = loop.create_future()
        self._queue.put(_Pending(row=row, loop=loop, future=future))
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
                outcomes = self._store([item.row for item in batch])
            except IntegrityError:  # another replica stored one of these keys since we looked: look again
                outcomes = self._store([_fresh(item.row) for item in batch])
        except Exception as error:  # the whole batch failed: every waiter hears it, nothing half-written
            log.warning("could not store %d new jobs: %s", len(batch), error)
            for item in batch:
                item.loop.call_soon_threadsafe(_set_exception, item.future, error)
            return
        self.batches_committed += 1
        for item, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Exception):
                item.loop.call_soon_threadsafe(_set_exception, item.future, outcome)
            else:
                item.loop.call_soon_threadsafe(_set_result, item.future, outcome)
        self._on_commit()

    def _store(self, rows: list[Job]) -> list[Accepted | Exception]:
        with session_scope(self._engine) as session:
            earlier = _jobs_by_key(session, rows)
            fresh: list[Job] = []
            slots: list[Job | tuple[Job, Job]] = []  # a new row, or (earlier job, this request's row)
            for row in rows:
                key = (row.owner, row.idempotency_key)
                if row.idempotency_key is not None and key in earlier:
                    slots.append((earlier[key], row))
                    continue
                if row.idempotency_key is not None:
                    earlier[key] = row  # a retry in this same batch answers with this job
                fresh.append(row)
                slots.append(row)
            session.add_all(fresh)
            session.flush()  # assigns ids
            for row in fresh:
                assert row.id is not None
                row.folder = self._folder_for(row.id)
                session.add(
                    JobEvent(
                        job_id=row.id,
                        from_state=None,
                        to_state=row.state,
                        reason="accepted",
                        attempt=row.attempt,
                        time=row.created_at,
                    )
                )
            if fresh:  # one multi-row INSERT: the audit log must not cost the writer an ORM object a job
                entries = [
                    {"time": row.created_at, "actor": row.owner, "action": "job.submit",
                     "target": f"job {row.id}", "detail": f"name={row.name}"}
                    for row in fresh
                ]  # fmt: skip
                session.execute(insert(AuditEntry), entries)
            session.flush()
            return [_outcome(slot) for slot in slots]


def _fresh(row: Job) -> Job:
    """The row as the request made it, for a retried batch: the failed flush gave it an id and folder."""
    return Job.model_validate(row.model_dump(exclude={"id", "folder"}))


def _jobs_by_key(session: Session, rows: list[Job]) -> dict[tuple[str, str | None], Job]:
    keys = {row.idempotency_key for row in rows if row.idempotency_key is not None}
    if not keys:
        return {}
    owners = {row.owner for row in rows}
    query = select(Job).where(col(Job.idempotency_key).in_(keys), col(Job.owner).in_(owners))
    return {(job.owner, job.idempotency_key): job for job in session.exec(query)}


def _outcome(slot: Job | tuple[Job, Job]) -> Accepted | Exception:
    if isinstance(slot, Job):
        return Accepted(JobPublic.model_validate(slot, from_attributes=True), replayed=False)
    earlier, row = slot
    try:
        check_same_request(earlier, row)
    except Exception as error:
        return error
    return Accepted(JobPublic.model_validate(earlier, from_attributes=True), replayed=True)


def _set_result(future: asyncio.Future[Accepted], value: Accepted) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Accepted], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
