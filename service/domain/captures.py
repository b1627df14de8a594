"""Who captures stacks when: one service per Runtime, for the stacks route and the watchdog alike.

A capture waits up to WAIT_S for a job's ranks (service.domain.capture), so it runs on threads of its
own (TORCHYARD_CAPTURE_THREADS), never on the API's: a request awaits its capture on the event loop
and holds no pool thread meanwhile. The house's fair share, for captures:
- one capture per job: a caller that comes while one is under way shares it;
- a few per user: a request that would start one more capture of a user's jobs past
  TORCHYARD_MAX_CAPTURES_PER_USER (or past TORCHYARD_MAX_CAPTURES in all) gets 429, and so does a
  user's request past TORCHYARD_MAX_CAPTURE_WAITERS_PER_USER waiting at once;
- owners in turn: captures not begun wait in one queue per job owner, and a free thread takes the
  first of the next owner's, so one user's many stalling jobs delay another user's capture by about
  one capture (the watchdog's captures are never refused, only queued in their owner's turn);
- a total deadline: a capture not begun in time is dropped, and no caller waits past its capture's
  deadline: a request then gets 409 with Retry-After (a capture begun is still kept as the last).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import anyio.to_thread
from sqlalchemy.engine import Engine

from service.backends.base import Backend
from service.config import Settings
from service.domain import capture
from service.domain.auth import Principal
from service.domain.quotas import RetryLater
from service.errors import Busy
from service.ledger.models.stacks import StackCapturePublic, Trigger

DEADLINE_S = 15.0  # from when a capture is asked to when its callers stop waiting for it
STORE_S = 1.0  # what reading, parsing and storing a capture may take after the ranks' wait
SLACK_S = 0.5  # a waiter's grace past the deadline: the capture's own last steps
RETRY_AFTER_S = capture.WAIT_S  # about when a capture under way has ended

Captured = Future[StackCapturePublic | None]


@dataclass(eq=False)
class _Flight:
    """One capture under way (queued or running) for one job; its callers share `future`."""

    job_id: int
    owner: str
    trigger: Trigger
    deadline: float  # monotonic
    future: Captured = field(default_factory=Future)


class Captures:
    """The captures of one Runtime: its threads, the capture under way per job, owners' turns."""

    def __init__(self, engine: Engine, backends: Mapping[str, Backend], settings: Settings) -> None:
        self._engine = engine
        self._backends = backends
        self._max_total = settings.max_captures
        self._max_per_owner = settings.max_captures_per_user
        self._max_waiters = settings.max_capture_waiters_per_user
        self._lock = threading.Lock()
        self._flights: dict[int, _Flight] = {}  # job id -> its capture under way
        self._turns: dict[str, deque[_Flight]] = {}  # owner -> captures not begun; owners in turn order
        self._owners: Counter[str] = Counter()  # owner -> captures under way of their jobs
        self._waiters: Counter[str] = Counter()  # user -> their requests waiting on a capture
        self._pool = ThreadPoolExecutor(settings.capture_threads, thread_name_prefix="torchyard-capture")

    def stop(self) -> None:
        """Captures running end (each within its deadline); those not begun are cancelled."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            left = [flight for queue in self._turns.values() for flight in queue]
            self._turns.clear()
        for flight in left:
            flight.future.cancel()

    def under_way(self) -> int:
        with self._lock:
            return len(self._flights)

    def submit(self, job_id: int, owner: str, trigger: Trigger) -> Captured:
        """The capture of this job under way, or a new one queued in `owner`'s turn. Never refused
        (the watchdog's way in); RuntimeError once stopped."""
        with self._lock:
            return self._join_or_queue(job_id, owner, trigger, capped=False).future

    async def job_stacks(
        self, job_id: int, viewer: Principal, capture_now: bool | None
    ) -> StackCapturePublic:
        """What GET /api/v1/jobs/{id}/stacks answers: for a running job a capture made now (unless
        `capture_now` is False), else the last capture kept (service.domain.capture.asked). Reads run
        on the API's threads for a moment; the capture is awaited with none held."""
        asking = await anyio.to_thread.run_sync(capture.asked, self._engine, job_id, viewer, capture_now)
        if not asking.capture:
            return capture.kept(self._engine, asking, reread=False)
        fresh = await self._await_capture(asking, viewer.user)
        if fresh is not None:
            return fresh
        return await anyio.to_thread.run_sync(capture.kept, self._engine, asking, True)

    async def _await_capture(self, asking: capture.Asked, user: str) -> StackCapturePublic | None:
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()

        def wake(_: Captured) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
                loop.call_soon_threadsafe(ended.set)

        with self._seat(user):
            with self._lock:
                flight = self._join_or_queue(asking.job_id, asking.owner, "request", capped=True)
            flight.future.add_done_callback(wake)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), max(0.0, flight.deadline + SLACK_S - time.monotonic()))
        if not flight.future.done() or flight.future.cancelled():
            raise Busy(
                f"the capture of job {asking.job_id}'s stacks did not end within {DEADLINE_S:.0f} s; "
                "what it captures is kept: ask again (?capture=false for the last capture)",
                retry_after_s=RETRY_AFTER_S,
                field="job_id",
            )
        return flight.future.result()

    @contextlib.contextmanager
    def _seat(self, user: str) -> Iterator[None]:
        with self._lock:
            if self._waiters[user] >= self._max_waiters:
                raise RetryLater(
                    f"you have {self._waiters[user]} stacks requests waiting, the limit is "
                    f"{self._max_waiters} (TORCHYARD_MAX_CAPTURE_WAITERS_PER_USER)",
                    retry_after_s=RETRY_AFTER_S,
                )
            self._waiters[user] += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters[user] -= 1
                if not self._waiters[user]:
                    del self._waiters[user]

    def _join_or_queue(self, job_id: int, owner: str, trigger: Trigger, capped: bool) -> _Flight:
        """With the lock held."""
        flight = self._flights.get(job_id)
        if flight is not None:
            return flight
        if capped:
            self._check_caps(owner)
        flight = _Flight(job_id, owner, trigger, time.monotonic() + DEADLINE_S)
        self._pool.submit(self._run_next)  # a thread for it; it takes whichever capture's turn it is
        self._flights[job_id] = flight
        self._owners[owner] += 1
        self._turns.setdefault(owner, deque()).append(flight)
        return flight

    def _check_caps(self, owner: str) -> None:
        if self._owners[owner] >= self._max_per_owner:
            raise RetryLater(
                f"{self._owners[owner]} stacks captures of {owner}'s jobs are under way, the limit is "
                f"{self._max_per_owner} (TORCHYARD_MAX_CAPTURES_PER_USER)",
                retry_after_s=RETRY_AFTER_S,
            )
        if len(self._flights) >= self._max_total:
            raise RetryLater(
                f"{len(self._flights)} stacks captures are under way, the service's limit is "
                f"{self._max_total} (TORCHYARD_MAX_CAPTURES)",
                retry_after_s=RETRY_AFTER_S,
            )

    def _run_next(self) -> None:
        """On a capture thread: the first capture of the owner whose turn it is."""
        with self._lock:
            flight = self._next_in_turn()
        if flight is None:  # stop() took it
            return
        if not flight.future.set_running_or_notify_cancel():
            self._done(flight)
            return
        try:
            result = self._capture(flight)
        except Exception as error:  # the callers' to see: each re-raises it
            self._done(flight)
            flight.future.set_exception(error)
        else:
            self._done(flight)
            flight.future.set_result(result)

    def _next_in_turn(self) -> _Flight | None:
        if not self._turns:
            return None
        owner = next(iter(self._turns))
        queue = self._turns.pop(owner)
        flight = queue.popleft()
        if queue:  # the owner's next capture waits for every other owner's turn
            self._turns[owner] = queue
        return flight

    def _capture(self, flight: _Flight) -> StackCapturePublic | None:
        if flight.deadline - time.monotonic() < capture.WAIT_S + STORE_S:
            raise Busy(
                f"the capture of job {flight.job_id}'s stacks could not begin within {DEADLINE_S:.0f} s: "
                "the capture threads are busy",
                retry_after_s=RETRY_AFTER_S,
                field="job_id",
            )
        deadline = flight.deadline - STORE_S
        return capture.capture_now(self._engine, self._backends, flight.job_id, flight.trigger, deadline)

    def _done(self, flight: _Flight) -> None:
        """Before its callers hear: one who asks after that starts a new capture."""
        with self._lock:
            if self._flights.get(flight.job_id) is flight:
                del self._flights[flight.job_id]
            self._owners[flight.owner] -= 1
            if not self._owners[flight.owner]:
                del self._owners[flight.owner]
