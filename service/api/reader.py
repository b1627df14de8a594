"""The reads every poll makes first, taken on the event loop through one connection of its own.

A poll reads the ledger clock (a list) or one job's stamp (a job) before anything else, and most
polls end there (304, or a rendering already kept in service.api.fragments). A thread-pool hop for
such a read costs more than the read. But an event loop must never wait on the shared pool (threads
that hold its connections may need the loop to finish), so this reader keeps one connection outside
the pool's contention. Only the event-loop thread uses it, and each read ends its transaction so the
next one sees new commits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session

from service.domain import jobs
from service.domain.auth import Principal
from service.ledger.clock import LedgerVersion, read_version_on
from service.ledger.models import Job

T = TypeVar("T")


class LedgerReader:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._connection: Connection | None = None

    def clock(self) -> LedgerVersion:
        return self._run(read_version_on)

    def job_stamp(self, job_id: int, viewer: Principal) -> datetime:
        """The job's `updated_at`; NotFound when it does not exist or `viewer` may not see it."""
        return self._run(lambda connection: jobs.job_stamp_on(connection, job_id, viewer))

    def page_index(self, query: jobs.PageQuery) -> jobs.PageIndex:
        """Only for a query that reads_a_range(): a filter may read many rows, in the thread pool."""
        return self._run(lambda connection: jobs.page_index(connection, query))

    def job(self, job_id: int, viewer: Principal) -> Job:
        """The job whole, to render it; NotFound as for job_stamp."""

        def read(connection: Connection) -> Job:
            with Session(bind=connection) as session:
                return jobs.get_job(session, job_id, viewer)

        return self._run(read)

    def jobs(self, job_ids: list[int]) -> list[Job]:
        """These jobs whole, to render a few that changed without a thread hop (see the route)."""

        def read(connection: Connection) -> list[Job]:
            with Session(bind=connection) as session:
                return jobs.jobs_by_id(session, job_ids)

        return self._run(read)

    def _run(self, read: Callable[[Connection], T]) -> T:
        for attempt in (1, 2):
            connection = self._connect()
            try:
                try:
                    return read(connection)
                finally:
                    connection.rollback()  # end the read transaction: the next read sees new commits
            except DBAPIError:
                self.close()  # a broken connection (database restarted): one fresh try
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _connect(self) -> Connection:
        if self._connection is None or self._connection.closed:
            self._connection = self._engine.connect()
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(DBAPIError):
                self._connection.close()
            self._connection = None
