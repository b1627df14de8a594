"""The watchdog's part of the reconcile loop: stalls noticed, flagged, captured, and (on_stall "fail")
ended as `hang`.

Inside the tick (`Watch.check`, in the job's own savepoint: a fault costs that job), each running job
is judged at most every CHECK_EVERY_S from what the ledger holds (its reports' times) and its
ranks' activity files (service.jobfs): no scheduler query. A job that makes progress again loses its
flag there and then. A job newly judged stalled is only noted: once the tick's transaction has
committed (`Watch.after_tick`), its ranks' stacks are captured by the Runtime's capture service
(service.domain.captures: one capture per job, owners served in turn, a total deadline; no
transaction open while the ranks write them), and once that capture ends the job is flagged in a
short transaction of its own, the reason naming which rank is where; with `on_stall: "fail"` it
asks the job's supervisor to restart it in place when its `restarts` cover `hang` and have some left
(service.loops.restarts), else ends the attempt as `hang` (a retry follows when `retries.on` holds
it) and has the backend stop the run.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.backends.base import Backend
from service.domain import watchdog
from service.domain.capture import last_capture
from service.domain.captures import Captured, Captures
from service.domain.endings import Ending
from service.domain.transitions import clear_stall, end_attempt, record_stall
from service.jobfs import read_activity
from service.ledger.db import write_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.loops.restarts import request_restart
from service.states import JobState
from worker.spec import Watchdog

log = logging.getLogger(__name__)

CHECK_EVERY_S = 2.0  # a job is judged at most this often (its ranks' activity files change every 5 s)
MAX_CHECKED = 10_000
MAX_REASON_CHARS = 4000


@dataclass(frozen=True)
class Suspect:
    """A job the tick found stalled, as it found it: flagged only if nothing moved since."""

    job_id: int
    owner: str
    backend: str
    external_id: str
    attempt: int
    progress_at: datetime | None
    reason: str  # from the activity files
    idle: str  # how long, and the threshold: what a capture's summary follows


class Watch:
    """The watchdog of one Reconciler (all its backends)."""

    def __init__(
        self,
        engine: Engine,
        backends: Mapping[str, Backend],
        captures: Captures,
        cancel: Callable[[str, str], None],
    ) -> None:
        self._engine = engine
        self._captures = captures
        self._cancel = cancel  # (backend name, run id): stop that run
        self._checked: dict[int, float] = {}  # job id -> when (monotonic) it was last judged
        self._suspects: dict[str, list[Suspect]] = {name: [] for name in backends}
        self._in_flight: set[int] = set()
        self._lock = threading.Lock()
        self.stalls_total = 0  # since start, for /metrics
        self.clock: Callable[[], float] = time.time  # epoch seconds (tests move it on)

    def check(self, session: Session, job: Job, backend_name: str) -> None:
        """Judge the running `job` (due at most every CHECK_EVERY_S): clear its flag when it moves
        again; note it for a capture when it newly stalled. In the caller's savepoint."""
        assert job.id is not None
        moment = time.monotonic()
        if moment - self._checked.get(job.id, float("-inf")) < CHECK_EVERY_S:
            return
        if len(self._checked) > MAX_CHECKED:  # jobs long gone: forgotten
            self._checked = {key: at for key, at in self._checked.items() if moment - at < 600}
        self._checked[job.id] = moment
        verdict = judge(job, self.clock())
        if not verdict.stalled:
            if job.stalled_at is not None:
                clear_stall(session, job)
            return
        if job.stalled_at is not None or job.external_id is None or not verdict.reason or not verdict.idle:
            return  # already flagged (the reason stands as captured)
        with self._lock:
            if job.id in self._in_flight:
                return
        attempt = job.run_attempt or job.attempt
        suspect = Suspect(
            job.id,
            job.owner,
            backend_name,
            job.external_id,
            attempt,
            job.progress_at,
            verdict.reason,
            verdict.idle,
        )
        self._suspects[backend_name].append(suspect)

    def after_tick(self, backend_name: str) -> None:
        """The tick committed: the jobs it found stalled are captured (in their owners' turns) and
        flagged once each capture ends, on the capture's thread."""
        suspects, self._suspects[backend_name] = self._suspects[backend_name], []
        for suspect in suspects:
            with self._lock:
                if suspect.job_id in self._in_flight:
                    continue
                self._in_flight.add(suspect.job_id)
            try:
                captured = self._captures.submit(suspect.job_id, suspect.owner, "stall")
            except RuntimeError:  # shutting down
                with self._lock:
                    self._in_flight.discard(suspect.job_id)
                continue
            captured.add_done_callback(functools.partial(self._flag, suspect))

    def _flag(self, suspect: Suspect, captured: Captured) -> None:
        try:
            if captured.cancelled():  # the service stops: the next one judges the job again
                return
            summary = _summary(suspect, captured)
            reason = f"{suspect.idle}; {summary}" if summary else suspect.reason
            if self._record(suspect, reason[:MAX_REASON_CHARS]):
                self._cancel(suspect.backend, suspect.external_id)
        except Exception:
            log.exception("job %s: the watchdog could not flag its stall", suspect.job_id)
        finally:
            with self._lock:
                self._in_flight.discard(suspect.job_id)

    def _record(self, suspect: Suspect, reason: str) -> bool:
        """Flag the job, if it is still the run found stalled and nothing moved since; with
        on_stall "fail" end the attempt as hang. True when its run must be stopped."""
        with write_scope(self._engine) as session:
            job = session.get(Job, suspect.job_id, with_for_update=True)
            if (
                job is None
                or JobState(job.state) is not JobState.running
                or job.external_id != suspect.external_id
                or job.stalled_at is not None
                or job.progress_at != suspect.progress_at
            ):
                return False
            record_stall(session, job, reason)
            self.stalls_total += 1
            log.warning("job %s stalled: %s", job.id, reason)
            if spec_watchdog(job).on_stall != "fail":
                return False
            if request_restart(session, job, reason):  # its supervisor restarts it in place
                return False
            end_attempt(session, job, Ending(JobState.failed, "hang", f"stalled: {reason}"))
            return True


def _summary(suspect: Suspect, captured: Captured) -> str | None:
    """The stacks summary of the capture made at the stall, or None (it failed, or had none)."""
    error = captured.exception()
    if error is not None:
        log.warning("job %s: stacks not captured at its stall: %s", suspect.job_id, error)
        return None
    found = captured.result()
    return found.summary if found is not None and found.summary else None


def judge(job: Job, now: float) -> watchdog.Verdict:
    """The watchdog's verdict on the running `job` at `now` (epoch seconds): its activity files read."""
    world = job.resources.world_size
    started = job.attempt_started_at.timestamp() if job.attempt_started_at else None
    attempt = job.run_attempt or job.attempt
    reported = job.progress_at.timestamp() if job.progress_at else None
    limit, basis = watchdog.threshold(spec_watchdog(job), job.report_times or [])
    if reported is not None and now - reported < limit and job.stalled_at is None:
        return watchdog.Verdict(False, limit, basis, now - reported, None)  # its reports say enough
    activity = read_activity(Path(job.folder), world, attempt) if job.folder else []
    return watchdog.decide(
        now=now,
        watchdog=spec_watchdog(job),
        attempt=attempt,
        world=world,
        started_at=started,
        progress_at=reported,
        report_times=job.report_times or [],
        activity=activity,
    )


def spec_watchdog(job: Job) -> Watchdog:
    return Watchdog.model_validate(job.spec.get("watchdog") or {})


def stacks_summary(session: Session, job: Job) -> str | None:
    """The summary of the current attempt's last stacks capture (None: none was made)."""
    last = last_capture(session, job.id or 0)
    if last is None or last.attempt != (job.run_attempt or job.attempt) or not last.summary:
        return None
    before = max(0.0, (utcnow() - last.captured_at).total_seconds())
    return f"{last.summary} (captured {before:.0f} s before, at a {last.trigger})"
