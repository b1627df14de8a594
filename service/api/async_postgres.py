"""PostgreSQL reads that the event loop waits for without blocking: psycopg2's asynchronous mode.

A poll's first read (service.api.reader) is made on the event loop. On PostgreSQL a blocking read
holds the loop for the whole round trip to a server that shares the machine's cores (profiled, the
loop spent a large share of its time blocked in the clock read: bench.scale, PostgreSQL). Here the
query is sent, and the loop serves other requests until the server's answer is readable on the
connection's socket. Not SQLAlchemy's asyncio engine (psycopg 3): its layers cost each read several
times the CPU of this one, on the loop (bench.reads).

The driver is the engine's own (`dialect.loaded_dbapi`, psycopg2, typed Any: it ships no types), with
the engine's connection arguments; its asynchronous connections are always in autocommit, so each
read sees every commit made before it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from sqlalchemy.engine import Engine

from service.api.driver_read import DriverRead
from service.ledger.db import POSTGRES_CONNECT_TIMEOUT_S


class AsyncPostgresPool:
    """`size` asynchronous connections: up to `size` reads in flight, the others wait their turn."""

    def __init__(self, engine: Engine, size: int) -> None:
        self._idle = [AsyncPostgres(engine) for _ in range(size)]
        self._turns = asyncio.Semaphore(size)

    async def __call__(self, read: DriverRead, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        async with self._turns:
            connection = self._idle.pop()
            try:
                return await connection(read, values)
            finally:
                self._idle.append(connection)

    def close(self) -> None:
        for connection in self._idle:
            connection.close()


class AsyncPostgres:
    """One asynchronous connection, one read at a time (AsyncPostgresPool makes sure); a broken
    connection (the database restarted) is replaced once per read."""

    def __init__(self, engine: Engine) -> None:
        self._driver: Any = engine.dialect.loaded_dbapi
        args, keywords = engine.dialect.create_connect_args(engine.url)
        self._connect_with = (list(args), {**keywords, "async_": True})
        self._connection: Any = None

    async def __call__(self, read: DriverRead, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        """The rows of `read` with these values, converted as SQLAlchemy converts them."""
        parameters = read.parameters(values)
        for attempt in (1, 2):
            try:
                connection = await self._connect()
                cursor = connection.cursor()
                try:
                    cursor.execute(read.sql, parameters)
                    await self._ready(connection)
                    rows = cursor.fetchall()
                finally:
                    cursor.close()
                return [read.converted(row) for row in rows]
            except self._driver.Error as error:
                self.close()
                if attempt == 2:
                    raise read.error(parameters, error) from error
            except BaseException:  # cancelled mid-read: the connection is left mid-query
                self.close()
                raise
        raise AssertionError("unreachable")

    async def _connect(self) -> Any:
        if self._connection is None or self._connection.closed:
            args, keywords = self._connect_with
            connection = self._driver.connect(*args, **keywords)  # begins; the polls below finish it
            try:
                # libpq's connect_timeout bounds only a blocking connect
                async with asyncio.timeout(POSTGRES_CONNECT_TIMEOUT_S):
                    await self._ready(connection)
            except BaseException:
                connection.close()
                raise
            self._connection = connection
        return self._connection

    async def _ready(self, connection: Any) -> None:
        """Until the connection has finished what it was asked (psycopg2's poll() protocol)."""
        extensions = self._driver.extensions
        loop = asyncio.get_running_loop()
        while True:
            state = connection.poll()
            if state == extensions.POLL_OK:
                return
            if state == extensions.POLL_READ:
                watch, unwatch = loop.add_reader, loop.remove_reader
            elif state == extensions.POLL_WRITE:
                watch, unwatch = loop.add_writer, loop.remove_writer
            else:
                raise self._driver.OperationalError(f"unexpected poll() state {state}")
            ready: asyncio.Future[None] = loop.create_future()
            socket = connection.fileno()
            watch(socket, _wake, ready)
            try:
                await ready
            finally:
                unwatch(socket)

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(self._driver.Error):
                self._connection.close()
            self._connection = None


def _wake(ready: asyncio.Future[None]) -> None:
    if not ready.done():
        ready.set_result(None)
