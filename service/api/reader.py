"""The reads every poll makes first, taken on the event loop through connections of its own.

A poll reads the ledger clock (a list) or one job's stamp (a job) before anything else, and most
polls end there (304, or a rendering already kept in service.api.fragments). A thread-pool hop for
such a read costs more than the read. But an event loop must never wait on the shared pool (threads
that hold its connections may need the loop to finish), so this reader keeps its connections
outside the pool's contention. Only the event-loop thread uses them, and each read sees every commit
made before it began.

Those first reads are made once per turn of the event loop (TurnReads), for every poll that asked
during the turn: 50 dashboards polling at once cost one clock read, or one read of the stamps of
the jobs they poll, instead of 50. Each poll's read still begins after the poll asked, so a commit
made before a poll began is never missed. On PostgreSQL a read is a round trip to a server that
shares the cores: the loop serves other requests while it waits (service.api.async_postgres); on
SQLite it takes µs, blocking. Both run on the driver's own cursor (service.api.driver_read): the
same statements through SQLAlchemy's execution cost each read twice the CPU on SQLite, and through
its asyncio engine (psycopg 3) several times on PostgreSQL (bench.reads).

Admission looks up the job of an Idempotency-Key the same way (`replayed`): in a worker thread on a
pooled connection, that read cost each keyed POST a thread's handoffs and four round trips to
PostgreSQL (the ping, BEGIN, the query, ROLLBACK) where this costs a share of one.

On SQLite a page is read on the loop too, but within a budget (ON_LOOP_BUDGET_S): a filter may
read many rows to find a page's few (a name with a state its matches seldom hold), and SQLite stops
such a read when the budget is spent (its progress handler); the page is then read in a worker
thread, at most READ_THREADS at once, each on a connection the reader keeps (OwnConnection): with a
thread per waiting poll the threads and the event loop fought for the GIL, and the loop's own reads
waited for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable, Collection
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import anyio
import anyio.to_thread
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Select

from service.api.async_postgres import AsyncPostgresPool
from service.api.driver_read import DriverRead
from service.domain import jobs, storing
from service.domain.auth import Principal
from service.domain.jobs import JobRow
from service.ledger.clock import CLOCK_ROW, LedgerVersion, version_of
from service.ledger.models.jobs import JobPublic

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")

READ_THREADS = 2
ON_LOOP_BUDGET_S = 0.002  # SQLite: how long a page read may hold the loop before a thread takes it
BUDGET_CHECK_STEPS = 1000  # SQLite virtual machine steps between looks at the clock (a few µs)
POSTGRES_CONNECTIONS = 4  # reads in flight from the event loop at once (PostgreSQL)


class LedgerReader:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._on_loop = OwnConnection(engine)
        self._off_loop_idle: list[OwnConnection] = []  # at most READ_THREADS: the limiter's bound
        self._postgres = (
            AsyncPostgresPool(engine, POSTGRES_CONNECTIONS)
            if engine.dialect.name == "postgresql" and engine.dialect.driver == "psycopg2"
            else None
        )
        self._clock_row = DriverRead(CLOCK_ROW, engine.dialect)
        self._clock = TurnReads[None, LedgerVersion](self._read_clock)
        self._stamps = TurnReads[int, jobs.Stamp](self._read_stamps)
        self._replays = TurnReads[storing.Key, JobPublic](self._read_replays)
        self._threads = anyio.CapacityLimiter(READ_THREADS)

    async def _fetch(self, read: DriverRead, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        """On PostgreSQL the loop serves on while the server answers; SQLite answers in µs."""
        if self._postgres is not None:
            return await self._postgres(read, values)
        return self._run(functools.partial(read.all, values=values))

    async def _read_clock(self, _: Collection[None]) -> dict[None, LedgerVersion]:
        rows = await self._fetch(self._clock_row, {})
        return {None: version_of(rows[0] if rows else None)}

    async def _read_stamps(self, job_ids: Collection[int]) -> dict[int, jobs.Stamp]:
        found: dict[int, jobs.Stamp] = {}
        for statement, values in jobs.stamp_reads(job_ids):
            found.update(jobs.stamps_found(await self._fetch(self._driver_read(statement), values)))
        return found

    async def _read_replays(self, keys: Collection[storing.Key]) -> dict[storing.Key, JobPublic]:
        found: dict[storing.Key, JobPublic] = {}
        for statement, values in storing.replay_reads(keys):
            found.update(storing.replays_found(await self._fetch(self._driver_read(statement), values)))
        return found

    @functools.cache  # noqa: B019 - one per statement (stamp sizes, page shapes) for the reader's life
    def _driver_read(self, statement: Select[Unpack[tuple[Any, ...]]]) -> DriverRead:
        return DriverRead(statement, self._engine.dialect)

    async def clock(self) -> LedgerVersion:
        version = await self._clock.read(None)
        assert version is not None  # the read answers its one key
        return version

    async def job_stamp(self, job_id: int, viewer: Principal) -> datetime:
        """The job's `updated_at`; NotFound when it does not exist or `viewer` may not see it."""
        return jobs.visible_stamp(await self._stamps.read(job_id), job_id, viewer)

    async def replayed(self, owner: str, key: str) -> JobPublic | None:
        """The job an earlier request of `owner` with this Idempotency-Key made (admission's step 3),
        read with every other lookup of the turn."""
        return await self._replays.read((owner, key))

    async def page_index(self, query: jobs.PageQuery) -> jobs.PageIndex:
        """On PostgreSQL from the event loop, waiting for the server without blocking. On SQLite on
        the loop within its budget, and in a read thread when that ran out."""
        if self._postgres is None:
            page = self._run(functools.partial(self._page_within_budget, query=query))
            if page is not None:
                return page
            return await self._off_loop(functools.partial(self._page_on, query=query))
        reads = jobs.page_reads("postgresql", query)
        try:
            statement, values = next(reads)
            while True:
                statement, values = reads.send(await self._fetch(self._driver_read(statement), values))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _page_on(self, connection: Connection, query: jobs.PageQuery) -> jobs.PageIndex:
        """A SQLite page's reads on the driver's cursor (half the CPU of SQLAlchemy's execution)."""

        def fetch(statement: jobs.PageStatement, values: dict[str, Any]) -> jobs.PageRows:
            return self._driver_read(statement).all(connection, values)

        return jobs.drive_page_reads(jobs.page_reads("sqlite", query), fetch)

    def _page_within_budget(self, connection: Connection, query: jobs.PageQuery) -> jobs.PageIndex | None:
        """_page_on, or None when SQLite stopped it at ON_LOOP_BUDGET_S."""
        driver: Any = connection.connection.driver_connection  # sqlite3's Connection
        deadline = time.perf_counter() + ON_LOOP_BUDGET_S
        driver.set_progress_handler(lambda: time.perf_counter() > deadline, BUDGET_CHECK_STEPS)
        try:
            return self._page_on(connection, query)
        except DBAPIError as error:
            if str(error.orig) == "interrupted":  # what sqlite3 says of a read its handler stopped
                return None
            raise
        finally:
            driver.set_progress_handler(None, 0)

    async def job(self, job_id: int, viewer: Principal) -> JobRow:
        """The job whole, to render it; NotFound as for job_stamp."""
        found = await self.jobs([job_id])
        stamp = (found[0]["updated_at"], found[0]["owner"]) if found else None
        jobs.visible_stamp(stamp, job_id, viewer)
        return found[0]

    async def jobs(self, job_ids: list[int]) -> list[JobRow]:
        """These jobs whole, to render those that changed: reads by id, from the loop as the first
        reads (a page of 500 changed jobs is a few ms on SQLite, and rendering them takes longer)."""
        found: list[JobRow] = []
        for statement, values in jobs.job_reads(job_ids):
            found.extend(jobs.jobs_found(await self._fetch(self._driver_read(statement), values)))
        return found

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
        if self._postgres is not None:
            self._postgres.close()


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
    scheduled when the first key of a turn is asked for, and starts after the tasks ready in that
    turn: the polls whose requests arrived together have all asked by then. While a read is in
    flight (PostgreSQL: the loop serves other requests meanwhile), the keys asked for wait for the
    next one, which starts when it ends: every read starts after its askers asked. An error of the
    read is every asker's error. Only the event-loop thread uses it.
    """

    def __init__(self, read_many: Callable[[Collection[K]], Awaitable[dict[K, V]]]) -> None:
        self._read_many = read_many
        self._waiting: dict[K, list[asyncio.Future[V | None]]] = {}
        self._in_flight: asyncio.Task[None] | None = None

    async def read(self, key: K) -> V | None:
        loop = asyncio.get_running_loop()
        if not self._waiting and self._in_flight is None:
            loop.call_soon(self._start)
        answer: asyncio.Future[V | None] = loop.create_future()
        self._waiting.setdefault(key, []).append(answer)
        return await answer

    def _start(self) -> None:
        waiting, self._waiting = self._waiting, {}
        self._in_flight = asyncio.get_running_loop().create_task(self._answer(waiting))

    async def _answer(self, waiting: dict[K, list[asyncio.Future[V | None]]]) -> None:
        try:
            found = await self._read_many(waiting.keys())
        except Exception as error:  # every asker's, raised in its own request
            for answers in waiting.values():
                for answer in answers:
                    if not answer.done():  # an asker that hung up has cancelled its answer
                        answer.set_exception(error)
        else:
            for key, answers in waiting.items():
                for answer in answers:
                    if not answer.done():
                        answer.set_result(found.get(key))
        finally:
            self._in_flight = None
            if self._waiting:  # asked while this read was in flight
                self._start()
