"""Code snapshots' copies made off the dispatch thread: a small pool, one copy at a time per user.

Unpacking a snapshot takes as long as its files are big (up to 4 x TORCHYARD_MAX_CODE_BYTES), and the
dispatch thread is every user's: a job whose copy is not there yet must not hold the tick. So the
dispatcher asks `ready` and gets the copy's tree, or raises what making it met, or, while it is being
made, Unpacking: the job goes back to the queue with that reason and is not claimed again until the
copy is made (`waiting`); every other job goes on. A copy is made once per (snapshot, account)
(service.domain.code_copies) by TORCHYARD_CODE_UNPACK_WORKERS threads, each user's copies one after
another (a user with many snapshots waits for their own, not another user's), each by a total deadline
(TORCHYARD_CODE_UNPACK_TIMEOUT_S).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from service.accounts import Account
from service.config import Settings
from service.domain.code_copies import build_copy, copy_tree, is_ready
from service.domain.code_store import digest_of, store_root
from worker.spec import RunSpec

FAILURE_KEPT_S = 60.0  # a failed copy's error is told to its waiting jobs; after this, a job tries again


class Unpacking(Exception):
    """The job's copy is being made: it waits in the queue, and no tick waits for it."""


@dataclass(frozen=True)
class _Copy:
    digest: str
    account: Account

    @property
    def key(self) -> tuple[str, str]:
        return self.digest, self.account.name


class CodePreparation:
    """The copies being made, and the jobs waiting for them. `ready` runs on the dispatch thread;
    the builds in the pool; `wake` is called when one ends, so that its jobs go at once."""

    def __init__(self, settings: Settings, wake: Callable[[], None]) -> None:
        self._settings = settings
        self._wake = wake
        self._pool = ThreadPoolExecutor(settings.code_unpack_workers, thread_name_prefix="torchyard-unpack")
        self._lock = threading.Lock()
        self._running: set[str] = set()  # users with a copy being made
        self._queued: defaultdict[str, deque[_Copy]] = defaultdict(deque)  # each user's, in order
        self._waiters: defaultdict[tuple[str, str], set[int]] = defaultdict(set)  # job ids, by copy
        self._failed: dict[tuple[str, str], tuple[BaseException, float]] = {}

    def ready(self, owner: str, spec: RunSpec, account: Account) -> Path:
        """The tree of the copy of the job's snapshot its account's jobs share, read-only, when it is
        made; else what making it raised (the job's to pay, as the dispatcher's handling of a job
        folder says), or Unpacking while it is being made."""
        assert spec.code is not None
        copy, job_id = _Copy(digest_of(spec.code), account), spec.job_id
        tree = copy_tree(self._settings, copy.digest, account)
        if is_ready(tree):
            return tree
        with self._lock:
            failed = self._failed.get(copy.key)
            if failed is not None and time.monotonic() - failed[1] < FAILURE_KEPT_S:
                raise failed[0]
            self._failed.pop(copy.key, None)
            if copy.key not in self._waiters:  # neither queued nor being made: ask for it
                self._queued[owner].append(copy)
            self._waiters[copy.key].add(job_id)
            self._start_next(owner)
        raise Unpacking("waiting for its code snapshot to be unpacked")

    def waiting(self) -> set[int]:
        """The jobs waiting for a copy: the dispatcher claims none of them until it is made."""
        with self._lock:
            return set().union(*self._waiters.values())

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _start_next(self, owner: str) -> None:
        """The owner's next copy, unless one of theirs is being made (call with the lock held)."""
        if owner in self._running or not self._queued[owner]:
            return
        copy = self._queued[owner].popleft()
        if not self._queued[owner]:
            del self._queued[owner]
        self._running.add(owner)
        self._pool.submit(self._build, owner, copy)

    def _build(self, owner: str, copy: _Copy) -> None:
        deadline = time.monotonic() + self._settings.code_unpack_timeout_s
        archive = store_root(self._settings) / f"{copy.digest}.tar.gz"
        failure: BaseException | None = None
        try:
            build_copy(self._settings, copy.digest, archive, copy.account, deadline)
        except Exception as error:  # told to the jobs waiting for it: the dispatcher judges it
            failure = error
        with self._lock:
            if failure is not None:
                self._failed[copy.key] = (failure, time.monotonic())
            self._waiters.pop(copy.key, None)
            self._running.discard(owner)
            self._start_next(owner)
        self._wake()
