"""What one of the reader's reads costs the process: its driver reads (service.api.driver_read; on
PostgreSQL from the event loop through service.api.async_postgres) against SQLAlchemy's own
execution of the same statements (Connection.execute; on PostgreSQL its asyncio engine on psycopg 3,
in autocommit like the reader's connections). CPU µs per read, best of 5 rounds, in one process.

Run: .venv/bin/python -m bench.reads [--jobs 10000] [--database-url postgresql://...]  (its jobs are emptied)
     PostgreSQL's comparison needs psycopg 3 beside the service's psycopg2: pip install 'psycopg[binary]'
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from bench.scale import empty_ledger
from bench.seed import seed_jobs, sqlite_url
from service.api.async_postgres import AsyncPostgresPool
from service.api.driver_read import DriverRead
from service.domain import jobs
from service.ledger.clock import CLOCK_ROW
from service.ledger.db import make_engine

ROUNDS, CALLS = 5, 300


async def cpu_us(read: Callable[[], Awaitable[object]]) -> float:
    for _ in range(CALLS // 10):
        await read()
    best = float("inf")
    for _ in range(ROUNDS):
        started = time.process_time()
        for _ in range(CALLS):
            await read()
        best = min(best, time.process_time() - started)
    return best / CALLS * 1e6


def statements(count: int) -> dict[str, tuple[Any, dict[str, Any]]]:
    newest = jobs.page_reads("sqlite", jobs.PageQuery(limit=50))  # its first read: the same on both
    return {
        "ledger clock": (CLOCK_ROW, {}),
        "one job's stamp": next(jobs.stamp_reads([count // 2])),
        "newest 50 page": next(newest),
        "50 jobs whole": next(jobs.job_reads(range(count - 49, count + 1))),
    }


async def driver_read(
    read: DriverRead, values: dict[str, Any], connection: Connection, pool: AsyncPostgresPool | None
) -> object:
    if pool is not None:
        return await pool(read, values)
    return read.all(connection, values)


async def sqlalchemy_read(
    statement: Any, values: dict[str, Any], connection: Connection, async_engine: AsyncEngine | None
) -> object:
    if async_engine is not None:
        async with async_engine.connect() as async_connection:
            return (await async_connection.execute(statement, values)).all()
    return connection.execute(statement, values).all()


async def compare(database_url: str, count: int) -> None:
    engine = make_engine(database_url)
    postgres = engine.dialect.name == "postgresql"
    theirs_label = "SQLAlchemy asyncio engine" if postgres else "SQLAlchemy Connection.execute"
    print(f"{'read':18s} {'driver read':>12s} {theirs_label:>30s}   ratio")
    pool = AsyncPostgresPool(engine, 1) if postgres else None
    psycopg_url = engine.url.set(drivername="postgresql+psycopg_async")
    sqlalchemy_async = create_async_engine(psycopg_url, isolation_level="AUTOCOMMIT") if postgres else None
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        for label, (statement, values) in statements(count).items():
            read = DriverRead(statement, engine.dialect)
            mine = await cpu_us(functools.partial(driver_read, read, values, connection, pool))
            theirs = functools.partial(sqlalchemy_read, statement, values, connection, sqlalchemy_async)
            other = await cpu_us(theirs)
            print(f"{label:18s} {mine:9.1f} µs {other:27.1f} µs   {other / mine:4.1f}x")
    if pool is not None and sqlalchemy_async is not None:
        pool.close()
        await sqlalchemy_async.dispose()
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--database-url", help="PostgreSQL database to fill (default: SQLite in a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        url = args.database_url or sqlite_url(Path(tmp))
        empty_ledger(url)
        seed_jobs(url, Path(tmp), args.jobs, running=args.jobs // 100)
        asyncio.run(compare(url, args.jobs))


if __name__ == "__main__":
    main()
