"""`retry --from STAGE`: which stages run again (that one and every stage downstream of it), and the
new job or sweep each gets, copied from the one it has now. Read in the transaction that stores them
(service.loops.intake), so that a retry racing another sees the first one's jobs.

A stage not rerun keeps its job (usually succeeded): the new jobs downstream of it run after that one.
The jobs a rerun replaces stay, with their pipeline and stage, as its history.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlmodel import Session, col, select

from service.domain.auth import Principal
from service.domain.notifications import notify_entries
from service.domain.pipeline_graph import check_stages, downstream
from service.domain.pipeline_state import read_outcomes
from service.domain.pipelines import get_pipeline_row, stage_rows
from service.errors import Conflict, InvalidRequest
from service.ledger.models.jobs import Job, NewJob
from service.ledger.models.notifications import NotifySpec
from service.ledger.models.pipelines import Dependency, Pipeline, PipelineCreate, PipelineStage
from service.ledger.models.sweeps import NewSweep, Sweep


@dataclass(frozen=True)
class Rerun:
    """A stage to run again, and what it runs now."""

    stage: PipelineStage
    job: NewJob | None = None
    sweep: NewSweep | None = None


@dataclass(frozen=True)
class RetryPlan:
    pipeline: Pipeline
    stages: dict[str, PipelineStage]  # every stage, by name
    reruns: list[Rerun]  # upstream before downstream


def plan_retry(session: Session, pipeline_id: int, start: str, viewer: Principal) -> RetryPlan:
    """What `retry --from start` makes; NotFound for a pipeline the viewer may not see, InvalidRequest
    for an unknown stage, Conflict while a stage it would rerun has not ended."""
    pipeline = get_pipeline_row(session, pipeline_id, viewer)
    session.refresh(pipeline, with_for_update=True)  # two retries of one pipeline take turns
    rows = {stage.name: stage for stage in stage_rows(session, pipeline_id)}
    if start not in rows:
        raise InvalidRequest(f"names no stage of pipeline {pipeline_id}: '{start}'", field="from")
    rerun = downstream({name: stage.after for name, stage in rows.items()}, start)
    busy = [one.name for one in read_outcomes(session, pipeline_id) if one.name in rerun and not one.ended]
    if busy:
        raise Conflict(
            f"stage{'s' if len(busy) > 1 else ''} {', '.join(busy)} of pipeline {pipeline_id} "
            "has not ended: cancel the pipeline or wait before retrying",
            field="from",
        )
    request = PipelineCreate.model_validate(pipeline.request)
    reruns = []
    for position in check_stages(request.stages):
        asked = request.stages[position]
        if asked.name in rerun:
            job = asked.job if asked.job is not None else (asked.sweep or {}).get("job")
            reruns.append(_rerun(session, rows[asked.name], _own_after(job), _notify_of(job)))
    return RetryPlan(pipeline, rows, reruns)


def _own_after(job: object) -> tuple[Dependency, ...]:
    """The job ids a stage's job (or its sweep's job) itself named in `after` (kept on every run)."""
    after = (job.get("after") if isinstance(job, dict) else None) or []
    assert isinstance(after, list), "a checked request's"
    return tuple(Dependency.model_validate(one if isinstance(one, dict) else {"job": one}) for one in after)


def _notify_of(job: object) -> tuple[NotifySpec, ...]:
    """The webhooks a stage's job (or its sweep's job) asked for: each new run is told as the first was."""
    return notify_entries(job.get("notify") if isinstance(job, dict) else None)


def _rerun(
    session: Session, stage: PipelineStage, own: tuple[Dependency, ...], notify: tuple[NotifySpec, ...]
) -> Rerun:
    if stage.job_id is not None:
        job = session.get(Job, stage.job_id)
        assert job is not None, "a stage's job stays"
        return Rerun(stage, job=_copy(job, own, notify))
    sweep = session.get(Sweep, stage.sweep_id)
    assert sweep is not None, "a stage's sweep stays"
    trials = session.exec(select(Job).where(col(Job.sweep_id) == sweep.id).order_by(col(Job.id))).all()
    return Rerun(
        stage,
        sweep=NewSweep(
            name=sweep.name,
            owner=sweep.owner,
            backend=sweep.backend,
            request=sweep.request,
            max_parallel=sweep.max_parallel,
            metric=sweep.metric,
            goal=sweep.goal,
            trials=[_copy(trial, own, notify) for trial in trials],
        ),
    )


def _copy(job: Job, own: tuple[Dependency, ...], notify: tuple[NotifySpec, ...]) -> NewJob:
    """A new run of `job`: the same spec, account, retry policy, parameters and webhooks."""
    return NewJob(
        name=job.name,
        owner=job.owner,
        backend=job.backend,
        spec=job.spec,
        run_as=job.run_as,
        retries=job.retries,
        params=job.params,
        after=own,
        notify=notify,
        pipeline_id=job.pipeline_id,
        stage=job.stage,
    )
