"""Long reads of the read path (service.api.reader) leave the event loop, READ_THREADS at a time."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import Connection

from service.api.reader import READ_THREADS, LedgerReader
from service.domain import jobs
from service.ledger.db import make_engine
from tests.support import run_async


def test_no_more_than_read_threads_long_reads_run_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    running, most, lock = 0, 0, threading.Lock()
    loop_thread: list[int] = []

    def slow_page_index(connection: Connection, query: jobs.PageQuery) -> jobs.PageIndex:
        nonlocal running, most
        assert threading.get_ident() not in loop_thread  # never on the event loop
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        return jobs.PageIndex([], None)

    monkeypatch.setattr(jobs, "page_index", slow_page_index)
    reader = LedgerReader(make_engine(f"sqlite:///{tmp_path / 'ledger.db'}"))

    async def scenario() -> None:
        loop_thread.append(threading.get_ident())
        await asyncio.gather(*(reader.page_index(jobs.PageQuery(name="abc")) for _ in range(8)))

    run_async(scenario())
    assert most == READ_THREADS
