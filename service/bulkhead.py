"""Bulkheads: one job's bad data or unexpected error costs that job, never the tick.

The loops handle many users' jobs in one pass (a reconcile tick, a dispatch batch, a retention pass).
Each job's part of a pass runs in `Bulkhead.guarded`: in a savepoint of its own when it writes the
ledger, so that what it wrote is undone and the rest of the transaction stands. An exception there
is logged with the job's id, counted (`torchyard_job_faults_total` at /metrics) and returned as a
`Fault`, whose reason the loop records on that job for its user to read; after FAIL_AFTER faults of
the same job in a row the loop gives up on it (the job fails with that reason). The pass goes on
with the next job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from sqlmodel import Session

from worker.spec import clean_text

log = logging.getLogger(__name__)

FAIL_AFTER = 3  # faults of one job in a row before its loop gives up on it
MAX_FAULT_CHARS = 2000  # of the error's own text in a reason

T = TypeVar("T")


@dataclass(frozen=True)
class Fault:
    """What went wrong with one job's part of a pass, and how often in a row."""

    job_id: int
    step: str
    count: int
    error: str  # the exception's type and text, cleaned and bounded

    @property
    def gives_up(self) -> bool:
        return self.count >= FAIL_AFTER

    @property
    def reason(self) -> str:
        """What the job's user reads: what failed, how, and what happens next."""
        then = "the job fails" if self.gives_up else f"tried again; the job fails after {FAIL_AFTER} in a row"
        return f"{self.step} failed on this job ({self.count} of {FAIL_AFTER}: {then}): {self.error}"


class Bulkhead:
    """One loop's step (`step` says what it does, for the reason) and its faults, per job."""

    def __init__(self, step: str) -> None:
        self.step = step
        self.faults_total = 0  # since start, for /metrics
        self._in_a_row: dict[int, int] = {}
        self._lock = threading.Lock()  # a loop per backend may share one

    def guarded(self, job_id: int, work: Callable[[], T], session: Session | None = None) -> T | Fault:
        """work(), or the Fault it raised. With a `session`, work() runs in a savepoint of it: its
        writes are undone on a fault, the session's other work stands."""
        try:
            if session is None:
                return self._succeeded(job_id, work())
            with session.begin_nested():
                result = work()
            return self._succeeded(job_id, result)
        except Exception as error:
            return self.fault(job_id, error)

    def fault(self, job_id: int, error: BaseException | str) -> Fault:
        """Count a fault of `job_id` (an exception, or a text saying what failed) and say it."""
        with self._lock:
            count = self._in_a_row[job_id] = self._in_a_row.get(job_id, 0) + 1
            self.faults_total += 1
            if count >= FAIL_AFTER:
                del self._in_a_row[job_id]  # given up: a next fault, if any, starts again
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        fault = Fault(job_id, self.step, count, clean_text(text, MAX_FAULT_CHARS))
        log.warning(
            "job %s: %s", job_id, fault.reason, exc_info=error if isinstance(error, BaseException) else None
        )
        return fault

    def _succeeded(self, job_id: int, result: T) -> T:
        if self._in_a_row:
            with self._lock:
                self._in_a_row.pop(job_id, None)
        return result
