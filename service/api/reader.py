"""The reads every poll makes first, taken on the event loop through one connection of its own.

A poll reads the ledger clock (a list) or one job's stamp (a job) before anything else, and most
polls end there (304, or a rendering already kept in service.api.fragments). A thread-pool hop for
such a read costs more than the read. But an event loop must never wait on the shared pool (threads
that hold its connections may need the loop to finish), so this reader keeps one connection outside
the pool's contention. Only the event-loop thread uses it, and each read ends its transaction so the
next one sees new commits.

Those first reads are made once per turn of the event loop (TurnReads), for every poll that asked
during the turn: 50 dashboards polling at once cost one clock read, or one read of the stamps of
the jobs they poll, instead of 50. Each poll's read still begins after the poll asked, so a commit
made before a poll began is never missed. On PostgreSQL a read is a round trip to the server that
blocks the loop (~0.5 ms with writers busy); on SQLite it is a few µs, and the clock read runs on
the driver's own cursor (DriverRead): SQLAlchemy's execution around it took ~20 µs (profiled).

Reads that may take long (a filtered page, many jobs to render) go to worker threads instead, at
most READ_THREADS at once, each on a connection the reader keeps (OwnConnection, as the loop's). With one thread per waiting poll (up to 40), the
threads and the event loop fought for the GIL: sampled under 32 polling connections, the loop spent
a fifth of its time waiting to get the GIL back after its own clock read, and filtered pages had a
p99 of 130-150 ms; with two threads 55-65 ms (bench.scale, 10^5 jobs, SQLite).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable, Collection, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

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
K = TypeVar("K")
V = TypeVar("V")

READ_THREADS = 2


class LedgerReader:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._on_loop = OwnConnection(engine)
        self._off_loop_idle: list[OwnConnection] = []  # at most READ_THREADS: the limiter's bound
        clock_row = DriverRead(CLOCK_ROW, engine.dialect)
        self._clock = TurnReads[None, LedgerVersion](
            lambda _: {None: self._run(lambda connection: version_of(clock_row.first(connection)))}
        )
        self._stamps = TurnReads[int, jobs.Stamp](self._read_stamps)
        self._threads = anyio.CapacityLimiter(READ_THREADS)

    def _read_stamps(self, job_ids: Collection[int]) -> dict[int, jobs.Stamp]:
        def execute(statement: jobs.StampStatement, values: dict[str, int]) -> list[tuple[Any, ...]]:
            return self._run(functools.partial(self._driver_read(statement).all, values=values))

        return jobs.stamps(execute, job_ids)

    @functools.cache  # noqa: B019 - one per statement (a few sizes) for the reader's life
    def _driver_read(self, statement: jobs.StampStatement) -> DriverRead:
        return DriverRead(statement, self._engine.dialect)

    async def clock(self) -> LedgerVersion:
        version = await self._clock.read(None)
        assert version is not None  # the read answers its one key
        return version

    async def job_stamp(self, job_id: int, viewer: Principal) -> datetime:
        """The job's `updated_at`; NotFound when it does not exist or `viewer` may not see it."""
        return jobs.visible_stamp(await self._stamps.read(job_id), job_id, viewer)

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
            # The limiter lets READ_THREADS reads run at once, so there are never more connections
            # than that; list.pop and append are atomic.
            own = self._off_loop_idle.pop() if self._off_loop_idle else OwnConnection(self._engine)
            try:
                return own.run(read)
            finally:
                self._off_loop_idle.append(own)

        return await anyio.to_thread.run_sync(run, limiter=self._threads)

    def _run(self, read: Callable[[Connection], T]) -> T:
        return self._on_loop.run(read)

    def close(self) -> None:
        for own in [self._on_loop, *self._off_loop_idle]:
            own.close()


class OwnConnection:
    """A connection one reader keeps for itself, outside the pool, in autocommit.

    Autocommit: each read is its own transaction, which sees every commit made before it. A pooled
    connection cost a read on PostgreSQL four round trips (the pool's ping, the driver's BEGIN, the
    query and the ROLLBACK that ends it); this costs one. A broken connection (the database
    restarted) is replaced once per read, where the pool's ping found it before.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._connection: Connection | None = None

    def run(self, read: Callable[[Connection], T]) -> T:
        for attempt in (1, 2):
            connection = self._connect()
            try:
                try:
                    return read(connection)
                finally:
                    connection.rollback()  # ends what a read began (an ORM session's), if anything
            except DBAPIError:
                self.close()
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _connect(self) -> Connection:
        if self._connection is None or self._connection.closed:
            self._connection = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(DBAPIError):
                self._connection.close()
            self._connection = None


class TurnReads(Generic[K, V]):
    """Reads asked for during one turn of the event loop, made as one read when the turn is done.

    `read_many(keys)` answers every key it finds (a key it leaves out answers None). The read is
    scheduled when the first key of a turn is asked for, and runs after the tasks ready in that turn:
    the polls whose requests arrived together have all asked by then. An error of the read is every
    asker's error. Only the event-loop thread uses it.
    """

    def __init__(self, read_many: Callable[[Collection[K]], dict[K, V]]) -> None:
        self._read_many = read_many
        self._waiting: dict[K, list[asyncio.Future[V | None]]] = {}

    async def read(self, key: K) -> V | None:
        loop = asyncio.get_running_loop()
        if not self._waiting:
            loop.call_soon(self._answer)
        answer: asyncio.Future[V | None] = loop.create_future()
        self._waiting.setdefault(key, []).append(answer)
        return await answer

    def _answer(self) -> None:
        waiting, self._waiting = self._waiting, {}
        try:
            found = self._read_many(waiting.keys())
        except Exception as error:  # every asker's, raised in its own request
            for answers in waiting.values():
                for answer in answers:
                    if not answer.done():  # an asker that hung up has cancelled its answer
                        answer.set_exception(error)
            return
        for key, answers in waiting.items():
            for answer in answers:
                if not answer.done():
                    answer.set_result(found.get(key))


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
        rows = self._execute(connection, values, lambda cursor: [cursor.fetchone()])
        return None if rows[0] is None else self._converted(rows[0])

    def all(self, connection: Connection, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Every row, converted; the driver's transaction is ended, as by `first`."""
        return [
            self._converted(row)
            for row in self._execute(connection, values, lambda cursor: cursor.fetchall())
        ]

    def _execute(
        self, connection: Connection, values: dict[str, Any], fetch: Callable[[Any], list[Any]]
    ) -> list[Any]:
        named = {**self._defaults, **values}
        parameters = [named[name] for name in self._positions] if self._positions else named
        driver = connection.connection.driver_connection
        assert driver is not None
        try:
            cursor = driver.cursor()
            try:
                cursor.execute(self._sql, parameters)
                return fetch(cursor)
            finally:
                cursor.close()
                driver.rollback()
        except self._error as error:
            raise DBAPIError.instance(self._sql, parameters, error, self._error) from error

    def _converted(self, row: Sequence[Any]) -> tuple[Any, ...]:
        converted = zip(self._convert, row, strict=True)
        return tuple(value if convert is None else convert(value) for convert, value in converted)
