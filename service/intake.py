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

from sqlalchemy.engine import Engine

from service.db import session_scope
from service.models import Job, JobEvent, JobPublic

log = logging.getLogger(__name__)

MAX_BATCH = 500


@dataclass
class _Pending:
    row: Job
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[JobPublic]


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

    async def add(self, row: Job) -> JobPublic:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[JobPublic] = loop.create_future()
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
            with session_scope(self._engine) as session:
                rows = [item.row for item in batch]
                session.add_all(rows)
                session.flush()  # assigns ids
                for row in rows:
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
                session.flush()
                published = [JobPublic.model_validate(row, from_attributes=True) for row in rows]
        except Exception as error:  # the whole batch failed: every waiter hears it, nothing half-written
            log.warning("could not store %d new jobs: %s", len(batch), error)
            for item in batch:
                item.loop.call_soon_threadsafe(_set_exception, item.future, error)
            return
        self.batches_committed += 1
        for item, public in zip(batch, published, strict=True):
            item.loop.call_soon_threadsafe(_set_result, item.future, public)
        self._on_commit()


def _set_result(future: asyncio.Future[JobPublic], value: JobPublic) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[JobPublic], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
