"""PostgreSQL reads that the event loop waits for without blocking: psycopg 3's asyncio connections.

A poll's first read (service.api.reader) is made on the event loop. On PostgreSQL a blocking read
would hold the loop for the whole round trip to a server that shares the machine's cores; here the
loop serves other requests until the server answers. The connections are psycopg's own
AsyncConnection with the engine's connection arguments, in autocommit: each read sees every commit
made before it began. Not SQLAlchemy's asyncio engine: its layers (greenlet switches, an execution
context per read) cost each read several times the CPU of this one, on the loop (bench.micro_reads).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from service.api.driver_read import DriverRead
from service.ledger.db import POSTGRES_CONNECT_TIMEOUT_S

if TYPE_CHECKING:
    import psycopg


class AsyncPostgresPool:
    """`size` connections: up to `size` reads in flight, the others wait their turn. A broken
    connection (the database restarted) is replaced once per read."""

    def __init__(self, engine: Engine, size: int) -> None:
        import psycopg  # the postgres extra's: a SQLite service runs without it

        self._psycopg = psycopg
        args, keywords = engine.dialect.create_connect_args(engine.url)
        self._connect_with = (list(args), {**keywords, "connect_timeout": POSTGRES_CONNECT_TIMEOUT_S})
        self._idle: list[psycopg.AsyncConnection[Any] | None] = [None] * size
        self._turns = asyncio.Semaphore(size)

    async def __call__(self, read: DriverRead, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        """The rows of `read` with these values, converted as SQLAlchemy converts them."""
        parameters = read.parameters(values)
        async with self._turns:
            connection = self._idle.pop()
            try:
                for attempt in (1, 2):
                    try:
                        if connection is None or connection.closed:
                            args, keywords = self._connect_with
                            connection = await self._psycopg.AsyncConnection.connect(
                                *args, **keywords, autocommit=True
                            )
                        async with connection.cursor() as cursor:
                            await cursor.execute(read.sql, parameters)
                            rows = await cursor.fetchall()
                        return [read.converted(row) for row in rows]
                    except self._psycopg.Error as error:
                        await _close(connection)
                        connection = None
                        if attempt == 2:
                            raise read.error(parameters, error) from error
                raise AssertionError("unreachable")
            except BaseException:  # cancelled mid-read: the connection is left mid-query
                await _close(connection)
                connection = None
                raise
            finally:
                self._idle.append(connection)

    async def close(self) -> None:
        for connection in self._idle:
            await _close(connection)


async def _close(connection: psycopg.AsyncConnection[Any] | None) -> None:
    if connection is not None:
        with contextlib.suppress(Exception):
            await connection.close()
