"""The reads every poll makes first, taken on the event loop through one connection of its own.

A poll reads the ledger clock (a list) or one job's stamp (a job) before anything else, and most
polls end there (304, or a rendering already kept in service.api.fragments). A thread-pool hop for
such a read costs more than the read. But an event loop must never wait on the shared pool (threads
that hold its connections may need the loop to finish), so this reader keeps one connection outside
the pool's contention. Only the event-loop thread uses it, and each read ends its transaction so the
next one sees new commits.

The two first reads (the clock, one job's stamp) run on the driver's own cursor (DriverRead): each
takes ~2 µs in SQLite, and SQLAlchemy's execution around it took ~20 µs (profiled), a tenth of a 304.

Reads that may take long (a filtered page, many jobs to render) go to worker threads on pooled
connections instead, at most READ_THREADS at once. With one thread per waiting poll (up to 40), the
threads and the event loop fought for the GIL: sampled under 32 polling connections, the loop spent
a fifth of its time waiting to get the GIL back after its own clock read, and filtered pages had a
p99 of 130-150 ms; with two threads 55-65 ms (bench.scale, 10^5 jobs, SQLite).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Select
from sqlmodel import Session

from service.domain import jobs
from service.domain.auth import Principal
from service.ledger.clock import CLOCK_ROW, LedgerVersion, version_of
from service.ledger.models import Job

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

T = TypeVar("T")

READ_THREADS = 2


class LedgerReader:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._connection: Connection | None = None
        self._clock = DriverRead(CLOCK_ROW, engine.dialect)
        self._stamp = DriverRead(jobs.STAMP, engine.dialect)
        self._threads = anyio.CapacityLimiter(READ_THREADS)

    def clock(self) -> LedgerVersion:
        return self._run(lambda connection: version_of(self._clock.first(connection)))

    def job_stamp(self, job_id: int, viewer: Principal) -> datetime:
        """The job's `updated_at`; NotFound when it does not exist or `viewer` may not see it."""

        def read(connection: Connection) -> datetime:
            return jobs.visible_stamp(self._stamp.first(connection, job_id=job_id), job_id, viewer)

        return self._run(read)

    def page_index(self, query: jobs.PageQuery) -> jobs.PageIndex:
        """Only for a query that reads_a_range(); a filter may read many rows: page_index_off_loop."""
        return self._run(functools.partial(jobs.page_index, query=query))

    async def page_index_off_loop(self, query: jobs.PageQuery) -> jobs.PageIndex:
        return await self._off_loop(functools.partial(jobs.page_index, query=query))

    def job(self, job_id: int, viewer: Principal) -> Job:
        """The job whole, to render it; NotFound as for job_stamp."""

        def read(connection: Connection) -> Job:
            with Session(bind=connection) as session:
                return jobs.get_job(session, job_id, viewer)

        return self._run(read)

    def jobs(self, job_ids: list[int]) -> list[Job]:
        """These jobs whole, to render a few that changed without a thread hop (see the route)."""
        return self._run(functools.partial(_jobs_on, job_ids=job_ids))

    async def jobs_off_loop(self, job_ids: list[int]) -> list[Job]:
        return await self._off_loop(functools.partial(_jobs_on, job_ids=job_ids))

    async def _off_loop(self, read: Callable[[Connection], T]) -> T:
        def run() -> T:
            with self._engine.connect() as connection:
                return read(connection)

        return await anyio.to_thread.run_sync(run, limiter=self._threads)

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


def _jobs_on(connection: Connection, job_ids: list[int]) -> list[Job]:
    with Session(bind=connection) as session:
        return jobs.jobs_by_id(session, job_ids)


class DriverRead:
    """A Core statement compiled once for the engine's driver, run on the driver's cursor: the same
    SQL and the same values (each column's result conversion is the one SQLAlchemy would apply), less
    the statement machinery. A driver error comes out as SQLAlchemy's (DBAPIError: an OperationalError
    is a database that is down, as everywhere else)."""

    def __init__(self, statement: Select[Unpack[tuple[Any, ...]]], dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self._sql = compiled.string
        self._defaults = dict(compiled.params)  # literals in the statement (`id == 1`)
        self._positions = compiled.positiontup  # a positional driver's (SQLite's `?`) order; else None
        self._convert = [
            column.type.dialect_impl(dialect).result_processor(dialect, None)
            for column in statement.selected_columns
        ]
        self._error: type[Exception] = dialect.loaded_dbapi.Error

    def first(self, connection: Connection, **values: Any) -> tuple[Any, ...] | None:
        """The first row, converted; the driver's transaction is ended (the next read sees new commits)."""
        named = {**self._defaults, **values}
        parameters = [named[name] for name in self._positions] if self._positions else named
        driver = connection.connection.driver_connection
        assert driver is not None
        try:
            cursor = driver.cursor()
            try:
                cursor.execute(self._sql, parameters)
                row = cursor.fetchone()
            finally:
                cursor.close()
                driver.rollback()
        except self._error as error:
            raise DBAPIError.instance(self._sql, parameters, error, self._error) from error
        if row is None:
            return None
        converted = zip(self._convert, row, strict=True)
        return tuple(value if convert is None else convert(value) for convert, value in converted)
