"""The reads every poll makes first, taken on the event loop through one connection of its own.

A poll reads the ledger clock (a list) or one job's stamp (a job) before anything else, and most
polls end there (304, or a rendering already kept in service.api.fragments). A thread-pool hop for
such a read costs more than the read. But an event loop must never wait on the shared pool (threads
that hold its connections may need the loop to finish), so this reader keeps one connection outside
the pool's contention. Only the event-loop thread uses it, and each read ends its transaction so the
next one sees new commits.

The two first reads (the clock, one job's stamp) run on the driver's own cursor (DriverRead): each
takes ~2 µs in SQLite, and SQLAlchemy's execution around it took ~20 µs (profiled), a tenth of a 304.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeVar

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


class LedgerReader:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._connection: Connection | None = None
        self._clock = DriverRead(CLOCK_ROW, engine.dialect)
        self._stamp = DriverRead(jobs.STAMP, engine.dialect)

    def clock(self) -> LedgerVersion:
        return self._run(lambda connection: version_of(self._clock.first(connection)))

    def job_stamp(self, job_id: int, viewer: Principal) -> datetime:
        """The job's `updated_at`; NotFound when it does not exist or `viewer` may not see it."""
        def read(connection: Connection) -> datetime:
            return jobs.visible_stamp(self._stamp.first(connection, job_id=job_id), job_id, viewer)

        return self._run(read)

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
