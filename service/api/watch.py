"""Long polls: a request that waits for one job to change is woken by the commit that changed it.

The ledger clock knows which jobs every commit stamped (service.ledger.clock.on_stamped_commit);
JobWatch hears of those commits and wakes only the requests waiting on one of those jobs, on their
own event loop. A commit made by another replica is not heard here, so a waiter also looks again
about every second (the route's RECHECK_S; one primary-key read), whatever it was told.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import Counter
from collections.abc import Collection, Iterator

from service.domain.quotas import RetryLater

# When the service stops, uvicorn waits for requests in flight, held long polls among them, before
# the lifespan can stop anything: give them this long, then cut them (clients ask again elsewhere).
SHUTDOWN_GRACE_S = 3


class JobChange:
    """Set by JobWatch when the job it was made for changes; wait() returns then (or on timeout)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()

    def notify(self) -> None:
        """From any thread: the committing one, which is seldom the waiter's event loop."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
            self._loop.call_soon_threadsafe(self._event.set)

    async def wait(self, timeout_s: float) -> bool:
        """True when told of a change, False after timeout_s; either way ready for the next wait."""
        try:
            await asyncio.wait_for(self._event.wait(), timeout_s)
        except TimeoutError:
            return False
        self._event.clear()
        return True


class JobWatch:
    """Who waits on which job. Thread-safe: commits arrive from the intake, dispatch and reconcile
    threads and from the thread pool, waiters register on the event loop.

    A held poll costs a connection and a task for up to MAX_WAIT_S, so there are only so many seats:
    `max_total` in all and `max_per_user` for one user; the next waiter hears 429 and asks again later."""

    def __init__(self, max_total: int, max_per_user: int) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[int, set[JobChange]] = {}
        self._max_total = max_total
        self._max_per_user = max_per_user
        self._held: Counter[str] = Counter()

    def changed(self, job_ids: Collection[int]) -> None:
        """These jobs were stamped by a commit that has completed."""
        with self._lock:
            if not self._waiting:
                return
            woken = [change for job_id in job_ids for change in self._waiting.get(job_id, ())]
        for change in woken:
            change.notify()

    @contextlib.contextmanager
    def watching(self, job_id: int, user: str) -> Iterator[JobChange]:
        """Register before reading the job, so that no commit between the read and the wait is missed;
        RetryLater when every seat is taken."""
        change = JobChange(asyncio.get_running_loop())
        with self._lock:
            self._take_seat(user)
            self._waiting.setdefault(job_id, set()).add(change)
        try:
            yield change
        finally:
            with self._lock:
                self._held[user] -= 1
                waiting = self._waiting.get(job_id)
                if waiting is not None:
                    waiting.discard(change)
                    if not waiting:
                        del self._waiting[job_id]

    def _take_seat(self, user: str) -> None:
        if self._held[user] >= self._max_per_user:
            raise RetryLater(
                f"you hold {self._held[user]} long polls, the limit is {self._max_per_user} "
                "(TORCHYARD_MAX_LONG_POLLS_PER_USER); wait for one to end",
                retry_after_s=1,
            )
        if self._held.total() >= self._max_total:
            raise RetryLater(
                f"this service holds {self._max_total} long polls, its limit (TORCHYARD_MAX_LONG_POLLS)",
                retry_after_s=1,
            )
        self._held[user] += 1

    def waiters(self) -> int:
        with self._lock:
            return sum(len(waiting) for waiting in self._waiting.values())
