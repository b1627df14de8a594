"""The sweep domain: read, list and cancel sweeps. The caller owns the transaction.

Creation is service.domain.submit (admission) and service.loops.intake (one commit for the sweep and
all its trials). A trial is an ordinary job with `sweep_id`: its state, retries and metrics are the
job's own, and a sweep's counts and comparisons are read from them, never stored twice.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select as core_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.backends.base import Backend
from service.domain import audit, metric_series
from service.domain.auth import Principal
from service.domain.cancel import cancel_jobs
from service.domain.cursors import decode_cursor, encode_cursor
from service.errors import NotFound
from service.ledger.models.history import JobAttempt
from service.ledger.models.jobs import Job, JobPublic
from service.ledger.models.metrics import JobMetricRollup
from service.ledger.models.sweeps import (
    EarlyStop,
    Search,
    Sweep,
    SweepCompute,
    SweepPage,
    SweepPublic,
    TrialPublic,
)
from service.states import EndingKind, JobState, is_terminal

MAX_PAGE = 200


def get_sweep_row(session: Session, sweep_id: int, viewer: Principal) -> Sweep:
    """The sweep, if it exists and `viewer` may see it; another user's sweep is as missing as none."""
    sweep = session.get(Sweep, sweep_id)
    if sweep is None or not viewer.may_see(sweep.owner):
        raise NotFound(f"sweep {sweep_id} not found", field="sweep_id")
    return sweep


def get_sweep(session: Session, sweep_id: int, viewer: Principal) -> SweepPublic:
    """The sweep with every trial, its state counts and its best trial."""
    sweep = get_sweep_row(session, sweep_id, viewer)
    return _public(sweep, _trials(session, [sweep])[sweep_id], with_trials=True)


def just_made(sweep: Sweep, jobs: Sequence[JobPublic]) -> SweepPublic:
    """A sweep as its request stored it, every trial queued: the answer to its POST, without a read."""
    trials = [
        TrialPublic(job_id=job.id, name=job.name, params=job.params or {}, state=job.state, reason=job.reason,
                    metric_last=None, metric_best=None)
        for job in jobs
    ]  # fmt: skip
    return _public(sweep, trials, with_trials=True)


def find_replayed(session: Session, owner: str, key: str) -> Sweep | None:
    """The sweep an earlier request of `owner` with this Idempotency-Key made."""
    query = select(Sweep).where(col(Sweep.owner) == owner, col(Sweep.idempotency_key) == key)
    return session.exec(query).first()


def list_sweeps(
    session: Session, viewer: Principal, *, limit: int = 50, cursor: str | None = None
) -> SweepPage:
    """Sweeps newest first, each with its counts and best trial (its trials are left out)."""
    query = select(Sweep).order_by(col(Sweep.id).desc()).limit(limit + 1)
    if (owner := viewer.owner_filter()) is not None:
        query = query.where(col(Sweep.owner) == owner)
    if cursor is not None:
        query = query.where(col(Sweep.id) < decode_cursor(cursor))
    sweeps = list(session.exec(query).all())
    more = len(sweeps) > limit
    sweeps = sweeps[:limit]
    trials = _trials(session, sweeps)
    items = [_public(sweep, trials[sweep.id or 0], with_trials=False) for sweep in sweeps]
    next_cursor = encode_cursor(sweeps[-1].id or 0) if more and sweeps else None
    return SweepPage(items=items, next_cursor=next_cursor)


def cancel_sweep(engine: Engine, sweep_id: int, backends: Mapping[str, Backend], viewer: Principal) -> None:
    """Cancel every unfinished trial: one scheduler call for all of them (service.domain.cancel)."""
    with Session(engine) as session:
        sweep = get_sweep_row(session, sweep_id, viewer)
        query = (
            core_select(col(Job.id), col(Job.state))
            .where(col(Job.sweep_id) == sweep_id)
            .order_by(col(Job.id))
        )
        unfinished = [job_id for job_id, state in session.execute(query) if not is_terminal(JobState(state))]
        owner = sweep.owner
    if unfinished:
        cancel_jobs(engine, unfinished, backends, viewer)
    with Session(engine) as session, session.begin():
        audit.record(
            session,
            viewer.user,
            "sweep.cancel",
            f"sweep {sweep_id}",
            f"owner={owner} trials={len(unfinished)}",
        )


# ---------------------------------------------------------------- reading trials


def _trials(session: Session, sweeps: Sequence[Sweep]) -> dict[int, list[TrialPublic]]:
    """Each sweep's trials, with the last and best value of the sweep's metric, how far each ran and
    how it ended: four queries in all."""
    ids = [sweep.id for sweep in sweeps if sweep.id is not None]
    found: dict[int, list[TrialPublic]] = {sweep_id: [] for sweep_id in ids}
    if not ids:
        return found
    metric_of = {sweep.id: sweep.metric for sweep in sweeps}
    columns = (
        col(Job.id),
        col(Job.sweep_id),
        col(Job.name),
        col(Job.params),
        col(Job.state),
        col(Job.reason),
        col(Job.resumes),
    )
    # A resumed trial (service.domain.sweep_resume) is its new job, in the stopped one's place.
    every = session.execute(core_select(*columns).where(col(Job.sweep_id).in_(ids))).all()
    resumed = {row.resumes for row in every if row.resumes is not None}
    shown = sorted((row for row in every if row.id not in resumed), key=lambda row: row.resumes or row.id)
    rows = [row[:-1] for row in shown]
    names = {metric for metric in metric_of.values() if metric}
    last, lowest, highest, steps = _metric_values(session, ids, names)
    endings = _endings(session, ids)
    for job_id, sweep_id, name, params, state, reason in rows:
        assert sweep_id is not None
        key = (job_id, metric_of[sweep_id])
        goal_best = lowest if _goal(sweeps, sweep_id) == "min" else highest
        found[sweep_id].append(
            TrialPublic(
                job_id=job_id,
                name=name,
                params=params or {},
                state=JobState(state),
                reason=reason,
                metric_last=last.get(key),
                metric_best=goal_best.get(key),
                steps=steps.get(key),
                ending=endings.get(job_id) if is_terminal(JobState(state)) else None,
            )
        )
    return found


def _endings(session: Session, sweep_ids: list[int]) -> dict[int, EndingKind | None]:
    """How each trial's latest attempt ended (JobAttempt.kind), for the trials that ended one."""
    trial_ids = select(col(Job.id)).where(col(Job.sweep_id).in_(sweep_ids)).scalar_subquery()
    query = (
        core_select(col(JobAttempt.job_id), col(JobAttempt.kind))
        .where(col(JobAttempt.job_id).in_(trial_ids))
        .order_by(col(JobAttempt.attempt))  # the latest one last
    )
    return {job_id: kind for job_id, kind in session.execute(query)}


def _metric_values(
    session: Session, sweep_ids: list[int], names: set[str]
) -> tuple[dict[tuple[int, str], float], dict[tuple[int, str], float], dict[tuple[int, str], float],
           dict[tuple[int, str], int]]:  # fmt: skip
    """(last, lowest, highest) value and the last step per (job, metric name) of the sweeps' trials:
    the last is the latest attempt's last step's, the last step the furthest any attempt reached.
    Read from the rollup's top level (service.domain.metric_series),
    a bucket or so per series, not from the raw rows: a page of sweeps of a thousand trials holds
    millions of those, and dashboards read the page again whenever a trial reports."""
    trial_ids = select(col(Job.id)).where(col(Job.sweep_id).in_(sweep_ids)).scalar_subquery()
    query = (
        core_select(
            col(JobMetricRollup.job_id),
            col(JobMetricRollup.name),
            col(JobMetricRollup.last_value),
            col(JobMetricRollup.min_value),
            col(JobMetricRollup.max_value),
            col(JobMetricRollup.last_step),
        )
        .where(
            col(JobMetricRollup.job_id).in_(trial_ids),
            col(JobMetricRollup.level) == metric_series.LEVELS,
            col(JobMetricRollup.name).in_(names),
        )
        .order_by(col(JobMetricRollup.attempt), col(JobMetricRollup.bucket))  # the last one last
    )
    last: dict[tuple[int, str], float] = {}
    lowest: dict[tuple[int, str], float] = {}
    highest: dict[tuple[int, str], float] = {}
    steps: dict[tuple[int, str], int] = {}
    for job_id, name, last_value, low, high, last_step in session.execute(query):
        key = (job_id, name)
        last[key] = last_value
        steps[key] = max(steps.get(key, 0), last_step)
        if key not in lowest or low < lowest[key]:  # the comparisons the buckets use (NaN never wins)
            lowest[key] = low
        if key not in highest or high > highest[key]:
            highest[key] = high
    return last, lowest, highest, steps


def _goal(sweeps: Sequence[Sweep], sweep_id: int) -> str:
    return next(sweep.goal for sweep in sweeps if sweep.id == sweep_id)


def best_trial(trials: Sequence[TrialPublic], goal: str) -> TrialPublic | None:
    """The trial whose last value of the metric is best; the first such on a tie; None before any."""
    scored = [trial for trial in trials if trial.metric_last is not None]
    if not scored:
        return None
    pick = min if goal == "min" else max
    return pick(scored, key=lambda trial: trial.metric_last or 0.0)


def _public(sweep: Sweep, trials: list[TrialPublic], *, with_trials: bool) -> SweepPublic:
    counts = Counter(trial.state for trial in trials)
    request: dict[str, Any] = sweep.request
    early_stop = EarlyStop.model_validate(request["early_stop"]) if request.get("early_stop") else None
    return SweepPublic(
        id=sweep.id or 0,
        name=sweep.name,
        owner=sweep.owner,
        backend=sweep.backend,
        size=sweep.size,
        max_parallel=sweep.max_parallel,
        metric=sweep.metric,
        goal="max" if sweep.goal == "max" else "min",
        grid=request.get("grid", {}),
        zip=request.get("zip", {}),
        job=request.get("job", {}),
        created_at=sweep.created_at,
        state="active" if _active(sweep, trials) else "finished",
        counts=dict(counts),
        best=best_trial(trials, sweep.goal),
        early_stop=early_stop,
        search=Search.model_validate(request["search"]) if request.get("search") else None,
        compute=compute_saved(early_stop, trials) if early_stop is not None else None,
        trials=trials if with_trials else [],
    )


def _active(sweep: Sweep, trials: list[TrialPublic]) -> bool:
    """A trial has not ended, or a search has trials still to make (between its waves all may have)."""
    to_make = sweep.search_trials is not None and sweep.size < sweep.search_trials
    return to_make or any(not is_terminal(trial.state) for trial in trials)


def trials_of(session: Session, sweep: Sweep) -> list[TrialPublic]:
    """The sweep's trials as its page shows them (service.loops.sweep_search learns from them)."""
    return _trials(session, [sweep])[sweep.id or 0]


def compute_saved(early_stop: EarlyStop, trials: Sequence[TrialPublic]) -> SweepCompute:
    """Steps run (each trial's last reported step, at most max_steps) against max_steps for each."""
    run = sum(min(trial.steps or 0, early_stop.max_steps) for trial in trials)
    full = early_stop.max_steps * len(trials)
    return SweepCompute(steps_run=run, steps_full=full, saved=round(1 - run / full, 4) if full else 0.0)
