"""How long an ended attempt waits for its ranks' files before the scheduler's word alone ends it.

A rank writes its error file (or rank 0 its result) before it exits, but the scheduler's word that the
job ended can reach the service first: on a shared file system (NFS caches what a folder holds for
seconds), a file written on a node shows up on the service's host later. Ended on the scheduler's
word alone, the same failure would read "NonZeroExitCode" or "ended without a result" on one tick and
the rank's traceback on the next: so an attempt that ended with nothing in its folder yet to tell how
is looked at again on the next ticks, for a short grace, before its ending is decided.
"""

from __future__ import annotations

import time
from collections.abc import Callable

MOST_WAITING = 10_000  # jobs whose grace is remembered; past it, the expired ones are forgotten


class FilesGrace:
    """Per job, when the scheduler was first seen saying its attempt ended. One reconcile thread per
    backend uses it, each for its own jobs, so no two threads ever touch one job's entry."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._grace_s = grace_s
        self._clock = clock
        self._since: dict[int, float] = {}

    def still_open(self, job_id: int) -> bool:
        """True while the ranks' files of `job_id` may yet appear; the grace starts at the first call."""
        now = self._clock()
        if len(self._since) >= MOST_WAITING:  # jobs cancelled during their grace are never settled
            self._since = {job: since for job, since in self._since.items() if now - since < self._grace_s}
        return now - self._since.setdefault(job_id, now) < self._grace_s

    def forget(self, job_id: int) -> None:
        """The job's ending is decided."""
        self._since.pop(job_id, None)
