"""Early stopping's part of the reconcile loop: after each tick, the trials that `early_stop` stops
(service.domain.sweep_pruning decides) are ended `cancelled` with the ending kind `pruned`, and the
backend is told to stop them with the tick's own cancels (no scheduler query of ours).

A pass decides only the sweeps whose trials the tick read new reports of (`reported`), and every
sweep with early_stop on the backend in the first pass after a start (reports read before a kill may
not have been decided yet); a tick with no new report costs no statement. What a pass reads is the
ledger's: the sweeps' trials' states, and for each rung the first row of the metric past the rung's
step (one grouped query per rung, not every report). A pass decides at most MAX_SWEEPS_PER_OWNER
sweeps of each owner, the others staying due for the next passes, so one user's many sweeps cannot
make another's wait (fair share); one sweep's fault costs that sweep's decision for this pass, never
the pass.

Why `cancelled` + the kind `pruned` rather than a new JobState: a stopped trial is stopped the way a
cancelled job is (the backend stops its run; nothing retries it, nothing follows it), and every state
list (terminal states, the dashboard's, the pipelines' rules, the reconciler's) would need a new entry
saying just that. The ending kind (JobAttempt.kind) is where the service already says why an attempt
ended, and the reason names the rung, its value and the cut; retries never take `pruned` (RetryOn).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import func
from sqlalchemy import select as core_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from service.domain.sweep_pruning import RungPoint, decide, rung_steps
from service.domain.transitions import record_transition
from service.ledger.db import session_scope, write_scope
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric
from service.ledger.models.sweeps import EarlyStop, Sweep
from service.states import WATCHED_STATES, JobState

log = logging.getLogger(__name__)

MAX_SWEEPS_PER_OWNER = 4  # decided in one pass; the others in the next passes, in turn


@dataclass(frozen=True)
class Stop:
    """A trial to end: its run on the backend, and why."""

    job_id: int
    external_id: str | None
    reason: str


class SweepPruning:
    """Decides after each reconcile tick; `cancel_later(backend, external_id)` is the tick's cancel.
    Each backend's thread keeps to its own entries of the dicts below."""

    def __init__(self, engine: Engine, cancel_later: Callable[[str, str], None]) -> None:
        self._engine = engine
        self._cancel_later = cancel_later
        self._due: dict[str, set[int]] = {}  # backend -> sweeps with new reports, not yet decided
        self._started: set[str] = set()  # backends whose first pass (every sweep) is done
        self._passes = 0
        self._decided: dict[int, int] = {}  # sweep id -> the pass that last decided it

    def reported(self, backend_name: str, sweep_id: int) -> None:
        """A trial of `sweep_id` reported: decide the sweep in this tick's pass."""
        self._due.setdefault(backend_name, set()).add(sweep_id)

    def after_tick(self, backend_name: str) -> int:
        """Stop what the rule stops among the due sweeps' trials. Returns how many were stopped."""
        due = self._due.setdefault(backend_name, set())
        first = backend_name not in self._started
        if not due and not first:
            return 0
        self._passes += 1
        with session_scope(self._engine) as session:
            sweeps = self._sweeps(session, backend_name, None if first else due)
            stops = [stop for sweep in sweeps for stop in self._guarded(session, sweep)]
        self._started.add(backend_name)
        if not stops:
            return 0
        stopped = 0
        with write_scope(self._engine) as session:
            for stop in stops:
                job = session.get(Job, stop.job_id, with_for_update=True)
                if job is None or JobState(job.state) not in WATCHED_STATES:
                    continue  # it ended meanwhile (its own end, a user's cancel): that ending stands
                record_transition(session, job, JobState.cancelled, stop.reason, kind="pruned")
                stopped += 1
        for stop in stops:  # committed: now the backend (the tick's cancels, retried until told)
            if stop.external_id is not None:
                self._cancel_later(backend_name, stop.external_id)
        return stopped

    def _sweeps(self, session: Session, backend_name: str, wanted: set[int] | None) -> list[Sweep]:
        """The sweeps with early_stop to decide now (`wanted`, or all with a trial on this backend),
        at most MAX_SWEEPS_PER_OWNER of each owner, those decided least recently first; taken off the
        due set (the others stay on it)."""
        query = core_select(Sweep).where(col(Sweep.backend) == backend_name)
        if wanted is not None:
            query = query.where(col(Sweep.id).in_(sorted(wanted)))
        else:
            active = core_select(col(Job.sweep_id)).where(
                col(Job.backend) == backend_name,
                col(Job.sweep_id).is_not(None),
                col(Job.state).in_([state.value for state in WATCHED_STATES]),
            )
            query = query.where(col(Sweep.id).in_(active.distinct().scalar_subquery()))
        taken: dict[str, int] = {}
        chosen: list[Sweep] = []
        due = self._due[backend_name]
        sweeps = [sweep for sweep in session.scalars(query) if sweep.id is not None]
        for sweep in sorted(sweeps, key=lambda sweep: (self._decided.get(sweep.id or 0, 0), sweep.id or 0)):
            sweep_id = sweep.id or 0
            if taken.get(sweep.owner, 0) >= MAX_SWEEPS_PER_OWNER:
                due.add(sweep_id)  # next pass
                continue
            due.discard(sweep_id)
            if sweep.request.get("early_stop"):
                taken[sweep.owner] = taken.get(sweep.owner, 0) + 1
                self._decided[sweep_id] = self._passes
                chosen.append(sweep)
        return chosen

    def _guarded(self, session: Session, sweep: Sweep) -> list[Stop]:
        try:
            return stops_of(session, sweep)
        except Exception:  # this sweep's bad data costs its decision this pass, not the others'
            log.exception("sweep %s: early stopping could not decide", sweep.id)
            return []


def stops_of(session: Session, sweep: Sweep) -> list[Stop]:
    """The trials of `sweep` that the rule stops and that a backend still holds."""
    early_stop = EarlyStop.model_validate(sweep.request["early_stop"])
    trials = session.execute(
        core_select(col(Job.id), col(Job.state), col(Job.external_id)).where(
            col(Job.sweep_id) == sweep.id, col(Job.resumes).is_(None)  # a resumed trial runs to its end
        )
    ).all()
    job_ids = [job_id for job_id, _, _ in trials]
    pruned = decide(early_stop, sweep.goal, job_ids, rung_points(session, sweep, early_stop))
    return [
        Stop(job_id, external_id, pruned[job_id].reason(sweep.metric))
        for job_id, state, external_id in trials
        if job_id in pruned and JobState(state) in WATCHED_STATES
    ]


def rung_points(session: Session, sweep: Sweep, early_stop: EarlyStop) -> list[RungPoint]:
    """Each trial's point at each rung it reached: the first row of the metric (the ledger's order)
    at or past the rung's step. One grouped query per rung: the rows are not read one by one."""
    trials = core_select(col(Job.id)).where(col(Job.sweep_id) == sweep.id).scalar_subquery()
    points: list[RungPoint] = []
    for rung, step in enumerate(rung_steps(early_stop)):
        first = (
            core_select(func.min(col(JobMetric.id)))
            .where(col(JobMetric.job_id).in_(trials), col(JobMetric.name) == sweep.metric,
                   col(JobMetric.step) >= step)
            .group_by(col(JobMetric.job_id))
            .scalar_subquery()
        )  # fmt: skip
        rows = session.execute(
            core_select(col(JobMetric.id), col(JobMetric.job_id), col(JobMetric.value)).where(
                col(JobMetric.id).in_(first)
            )
        )
        points.extend(RungPoint(row_id, job_id, rung, step, value) for row_id, job_id, value in rows)
    return points
