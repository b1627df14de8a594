"""Polls wait for POSTs in flight (service.api.writers_first), but never longer than MAX_HOLD_S."""

from __future__ import annotations

import asyncio
import time

from service.api.writers_first import MAX_HOLD_S, WritersFirst
from tests.support import run_async


def test_a_read_starts_at_once_with_no_writer_and_after_the_writer_otherwise() -> None:
    async def scenario() -> list[str]:
        writers, order = WritersFirst(), []
        await asyncio.wait_for(writers.before_read(), 0.001)  # nobody writing: no wait at all

        async def write() -> None:
            with writers.writing():
                await asyncio.sleep(0.01)
                order.append("written")

        async def read() -> None:
            await writers.before_read()
            order.append("read")

        writing = asyncio.create_task(write())
        await asyncio.sleep(0)  # the writer is in flight
        await asyncio.gather(read(), writing)
        return order

    assert run_async(scenario()) == ["written", "read"]


def test_a_flood_of_writers_holds_a_read_no_longer_than_the_limit() -> None:
    async def scenario() -> float:
        writers = WritersFirst()
        with writers.writing():  # a writer that never ends while the read waits
            began = time.monotonic()
            await writers.before_read()
            return time.monotonic() - began

    held = run_async(scenario())
    assert MAX_HOLD_S * 0.9 <= held < MAX_HOLD_S + 0.5
