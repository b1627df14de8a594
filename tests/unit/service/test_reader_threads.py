"""Long reads of the read path (service.api.reader) leave the event loop, READ_THREADS at a time; a
SQLite page is read on the loop until its budget runs out."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy import insert
from sqlalchemy.engine import Connection, Engine

from service.api import reader as reader_module
from service.api.reader import READ_THREADS, LedgerReader
from service.domain import jobs
from service.ledger.db import make_engine, migrate
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.support import run_async


def sqlite_ledger(tmp_path: Path, names: list[str]) -> Engine:
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    migrate(engine)
    now = utcnow()
    rows = [
        {"name": name, "owner": "alice", "backend": "local", "state": JobState.succeeded.value, "spec": {},
         "attempt": 1, "progress_offset": 0, "cancel_requested": False, "created_at": now, "updated_at": now}
        for name in names
    ]  # fmt: skip
    if rows:
        with engine.begin() as connection:
            connection.execute(insert(Job), rows)
    return engine


def test_no_more_than_read_threads_long_reads_run_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, most, lock = 0, 0, threading.Lock()
    loop_thread: list[int] = []

    def slow_page(connection: Connection, query: jobs.PageQuery) -> jobs.PageIndex:
        nonlocal running, most
        assert threading.get_ident() not in loop_thread  # never on the event loop
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        return jobs.PageIndex([], None)

    reader = LedgerReader(sqlite_ledger(tmp_path, []))
    monkeypatch.setattr(reader, "_page_within_budget", lambda connection, query: None)  # always past it
    monkeypatch.setattr(reader, "_page_on", slow_page)

    async def scenario() -> None:
        loop_thread.append(threading.get_ident())
        await asyncio.gather(*(reader.page_index(jobs.PageQuery(name="abc")) for _ in range(8)))

    run_async(scenario())
    assert most == READ_THREADS


def test_a_sqlite_page_is_read_on_the_loop_until_its_budget_runs_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name whose 60,000 matches are all in another state reads every match to find none: SQLite
    stops it on the loop, and a read thread answers it whole. A page found quickly stays on the loop."""
    engine = sqlite_ledger(tmp_path, [f"same-{n}" for n in range(60_000)])
    reader = LedgerReader(engine)
    threads: list[tuple[str, int]] = []
    page_on = reader._page_on

    def recorded(connection: Connection, query: jobs.PageQuery) -> jobs.PageIndex:
        threads.append((query.name or "", threading.get_ident()))
        return page_on(connection, query)

    monkeypatch.setattr(reader, "_page_on", recorded)
    slow = jobs.PageQuery(name="same", state=(JobState.running,))
    quick = jobs.PageQuery(name="same-59999")
    loop_thread = 0

    async def scenario() -> tuple[jobs.PageIndex, jobs.PageIndex]:
        nonlocal loop_thread
        loop_thread = threading.get_ident()
        await reader.page_index(quick)  # its statement compiled, once, within the budget too
        threads.clear()
        slow_page = await reader.page_index(slow)
        # The budget is wall time: on a busy machine (CI's two cores) a quick read preempted for a few
        # ms would go to a thread. Its read takes µs; a budget of 0.5 s tells the same apart.
        monkeypatch.setattr(reader_module, "ON_LOOP_BUDGET_S", 0.5)
        return slow_page, await reader.page_index(quick)

    slow_page, quick_page = run_async(scenario())
    with engine.connect() as connection:
        assert slow_page == jobs.page_index(connection, slow) and slow_page.entries == []
        assert quick_page == jobs.page_index(connection, quick) and len(quick_page.entries) == 1
    on_loop = [(name, ident == loop_thread) for name, ident in threads]
    assert on_loop == [("same", True), ("same", False), ("same-59999", True)]
    reader.close()
