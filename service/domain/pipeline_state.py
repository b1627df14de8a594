"""A pipeline's state, decided from its stages' in the transaction that ends one of its jobs.

The transitions door (service.domain.transitions) calls `settle_pipeline` whenever a job of a pipeline
reaches a terminal state; the rule itself (`stage_outcome`, `pipeline_outcome`) is pure. A pipeline is
running while any stage's current job (or trial) has not ended; then succeeded when every stage
succeeded, cancelled when its user cancelled one of them (a pipeline's cancel cancels them all), else
failed, with a reason naming the first stage, in the order given, that failed on its own (not
cancelled because a stage before it did not end as asked).

This module imports nothing of transitions (which imports it); the reasons it reads back are
service.domain.endings'. A pipeline that changed state has its notice written (service.domain.outbox).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import or_
from sqlalchemy import select as core_select
from sqlmodel import Session, col, select

from service.domain.endings import CANCELLED_BY_USER, DEPENDENCY, PRUNED
from service.domain.outbox import note_pipeline
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.pipelines import Pipeline, PipelineStage
from service.states import TERMINAL_STATE_NAMES, JobState

ACTIVE = "active"  # a sweep stage's state while any of its trials has not ended



@dataclass(frozen=True)
class StageOutcome:
    """A stage as its current job, or its sweep's trials, stand now."""

    name: str
    state: str  # a job state, or ACTIVE for a sweep with a trial not ended
    reason: str | None

    @property
    def ended(self) -> bool:
        return self.state in TERMINAL_STATE_NAMES


def stage_outcome(name: str, jobs: Sequence[tuple[str, str | None]], *, sweep: bool = False) -> StageOutcome:
    """A stage from its jobs' (state, reason): one job's own; a sweep's trials: ACTIVE while any has
    not ended, succeeded when all did (a trial its early_stop stopped counts as done: stopping it was
    the sweep's own doing), else the first that did not succeed."""
    if not sweep:
        return StageOutcome(name, jobs[0][0], jobs[0][1])
    if any(state not in TERMINAL_STATE_NAMES for state, _ in jobs):
        return StageOutcome(name, ACTIVE, None)
    for state, reason in jobs:
        if state != JobState.succeeded.value and not _pruned(state, reason):
            return StageOutcome(name, state, reason)
    return StageOutcome(name, JobState.succeeded.value, None)


def _pruned(state: str, reason: str | None) -> bool:
    return state == JobState.cancelled.value and (reason or "").startswith(PRUNED)


def pipeline_outcome(stages: Sequence[StageOutcome]) -> tuple[str, str | None]:
    """(state, reason) of a pipeline whose stages, in the order given, stand as `stages`."""
    if any(not stage.ended for stage in stages):
        return "running", None
    unsucceeded = [stage for stage in stages if stage.state != JobState.succeeded.value]
    if not unsucceeded:
        return "succeeded", None
    if any(stage.state == JobState.cancelled.value and stage.reason == CANCELLED_BY_USER for stage in stages):
        return "cancelled", CANCELLED_BY_USER
    own = [stage for stage in unsucceeded if not (stage.reason or "").startswith(DEPENDENCY)]
    first = (own or unsucceeded)[0]
    return "failed", f"stage '{first.name}' {first.state}: {first.reason or 'no reason given'}"


def read_outcomes(session: Session, pipeline_id: int) -> list[StageOutcome]:
    """Its stages as they stand, in the order given."""
    return [outcome for _, outcome in read_stages(session, [pipeline_id]).get(pipeline_id, [])]


def read_stages(
    session: Session, pipeline_ids: Sequence[int]
) -> dict[int, list[tuple[PipelineStage, StageOutcome]]]:
    """Each pipeline's stages, in the order given, with how they stand: two reads for any number of
    pipelines (the stages, then their current jobs and trials)."""
    stages = session.exec(
        select(PipelineStage)
        .where(col(PipelineStage.pipeline_id).in_(pipeline_ids))
        .order_by(col(PipelineStage.pipeline_id), col(PipelineStage.position))
    ).all()
    job_ids = [stage.job_id for stage in stages if stage.job_id is not None]
    sweep_ids = [stage.sweep_id for stage in stages if stage.sweep_id is not None]
    by_job: dict[int, tuple[str, str | None]] = {}
    by_sweep: dict[int, list[tuple[str, str | None]]] = {}
    if job_ids or sweep_ids:
        # session.execute, not its connection: it flushes first the job whose move called us
        rows = session.execute(
            core_select(col(Job.id), col(Job.sweep_id), col(Job.state), col(Job.reason))
            .where(or_(col(Job.id).in_(job_ids), col(Job.sweep_id).in_(sweep_ids)))
            .order_by(col(Job.id))
        ).all()
        for job_id, sweep_id, state, reason in rows:
            value = (JobState(state).value, reason)
            if sweep_id is not None and sweep_id in sweep_ids:
                by_sweep.setdefault(sweep_id, []).append(value)
            by_job[job_id] = value
    found: dict[int, list[tuple[PipelineStage, StageOutcome]]] = {}
    for stage in stages:
        if stage.job_id is not None:
            jobs = [by_job[stage.job_id]] if stage.job_id in by_job else []
        else:
            jobs = by_sweep.get(stage.sweep_id or 0, [])
        outcome = stage_outcome(stage.name, jobs or [(ACTIVE, None)], sweep=stage.sweep_id is not None)
        found.setdefault(stage.pipeline_id, []).append((stage, outcome))
    return found


def settle_pipeline(session: Session, pipeline_id: int) -> None:
    """Decide the pipeline's state again from its stages; when it changed, write it (with when it
    finished, and why) and its notice (once per change of state: not when a retry sets it running)."""
    pipeline = session.get(Pipeline, pipeline_id, with_for_update=True)
    if pipeline is None:
        return
    state, reason = pipeline_outcome(read_outcomes(session, pipeline_id))
    if (state, reason) == (pipeline.state, pipeline.reason):
        return
    now = utcnow()
    moved = state != pipeline.state
    pipeline.state, pipeline.reason, pipeline.updated_at = state, reason, now
    pipeline.finished_at = None if state == "running" else (pipeline.finished_at if not moved else now)
    session.add(pipeline)
    if moved:
        note_pipeline(session, pipeline_id, state, reason)
