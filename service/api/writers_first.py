"""Writers first: while a POST is being admitted, polls wait before they start reading.

One event loop serves every request, and a POST needs several turns of it (policy, room, intake's
group commit, the answer). With 50 pollers every turn waited behind all their requests: a POST was
slow and the writer fell far short of its rate (bench.poll --busy 20 reports both). Reads that have
not started yet wait for the writers in flight instead (at most MAX_HOLD_S: a flood of POSTs must
not stop every reader), so a POST's turns hold only its own work and the reads already under way.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

MAX_HOLD_S = 0.05


class WritersFirst:
    """Used on the event loop only (routes), so a plain counter needs no lock."""

    def __init__(self) -> None:
        self._writing = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        self._writing += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._writing -= 1
            if self._writing == 0:
                self._idle.set()

    async def before_read(self) -> None:
        """Return at once when no writer is in flight; else when they are done, or after MAX_HOLD_S."""
        if self._writing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), MAX_HOLD_S)
