"""A pipeline stored in one transaction, and a `retry --from`'s new jobs in one: the intake's part
(service.loops.intake calls these inside its write scope; its own inserts make the jobs and sweeps).

Stages are stored upstream first, so that each stage's jobs can name, in `after`, every job of each
stage upstream of it (a sweep stage's: all its trials) with the stage's `on`: the dependencies engine
(service.domain.dependencies) then runs a pipeline as it runs any jobs with `after`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from sqlmodel import Session, col, select

from service.domain import audit, pipelines
from service.domain.auth import Principal
from service.domain.pipeline_retry import plan_retry
from service.domain.quotas import UnfinishedCount
from service.domain.storing import SweepAccepted
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job, JobPublic, NewJob
from service.ledger.models.pipelines import (
    Dependency,
    NewPipeline,
    Pipeline,
    PipelineAccepted,
    PipelineStage,
)
from service.ledger.models.sweeps import NewSweep

InsertJobs = Callable[[Session, Sequence[NewJob]], list[JobPublic]]
InsertSweep = Callable[[Session, NewSweep], SweepAccepted]


def store_pipeline(
    session: Session,
    pipeline: NewPipeline,
    max_active: int | None,
    insert_jobs: InsertJobs,
    insert_sweep: InsertSweep,
) -> PipelineAccepted:
    """The pipeline, its stages and all their jobs; the first pipeline when its Idempotency-Key was
    used (Conflict for another request); TooManyUnfinished (raised: nothing is stored) when its jobs
    would take the owner past `max_active`."""
    if pipeline.idempotency_key is not None:
        earlier = pipelines.find_replayed(session, pipeline.owner, pipeline.idempotency_key)
        if earlier is not None:
            return pipelines.replay_pipeline(earlier, pipeline.request)
    jobs = sum(1 if stage.job is not None else len(stage.sweep.trials) if stage.sweep else 0
               for stage in pipeline.stages)  # fmt: skip
    _take_room(session, pipeline.owner, max_active, jobs)
    row = Pipeline(
        name=pipeline.name,
        owner=pipeline.owner,
        request=pipeline.request,
        idempotency_key=pipeline.idempotency_key,
        created_at=pipeline.created_at,
        updated_at=pipeline.created_at,
    )
    session.add(row)
    session.flush()  # its id, which the stages' jobs carry
    assert row.id is not None
    made: dict[str, list[int]] = {}
    for stage in pipeline.stages:
        upstream = _upstream(made, stage.after, stage.on)
        job_id, sweep_id, made[stage.name] = _store_stage(
            session, row.id, stage.name, upstream, stage.job, stage.sweep, insert_jobs, insert_sweep
        )
        session.add(
            PipelineStage(pipeline_id=row.id, name=stage.name, position=stage.position,
                          after=list(stage.after), on=stage.on, job_id=job_id, sweep_id=sweep_id)
        )  # fmt: skip
    audit.record(session, pipeline.owner, "pipeline.submit", f"pipeline {row.id}", f"name={pipeline.name}")
    return PipelineAccepted(row.id, replayed=False)


def store_retry(
    session: Session,
    pipeline_id: int,
    start: str,
    viewer: Principal,
    max_active: int | None,
    insert_jobs: InsertJobs,
    insert_sweep: InsertSweep,
) -> None:
    """New jobs for `start` and every stage downstream of it (service.domain.pipeline_retry); the
    stages point at them, and the pipeline runs again."""
    plan = plan_retry(session, pipeline_id, start, viewer)
    jobs = sum(1 if one.job is not None else len(one.sweep.trials) if one.sweep else 0 for one in plan.reruns)
    _take_room(session, plan.pipeline.owner, max_active, jobs)
    made = _current_jobs(session, plan.stages)
    for rerun in plan.reruns:
        stage = rerun.stage
        upstream = _upstream(made, stage.after, stage.on)
        stage.job_id, stage.sweep_id, made[stage.name] = _store_stage(
            session, pipeline_id, stage.name, upstream, rerun.job, rerun.sweep, insert_jobs, insert_sweep
        )
        stage.runs += 1
        session.add(stage)
    pipeline = plan.pipeline
    pipeline.state, pipeline.reason, pipeline.finished_at, pipeline.updated_at = (
        "running",
        None,
        None,
        utcnow(),
    )
    session.add(pipeline)
    rerun_names = ",".join(one.stage.name for one in plan.reruns)
    audit.record(session, viewer.user, "pipeline.retry", f"pipeline {pipeline_id}",
                 f"owner={pipeline.owner} from={start} stages={rerun_names}")  # fmt: skip


def _take_room(session: Session, owner: str, max_active: int | None, jobs: int) -> None:
    """Count all the jobs at once against the owner's unfinished ones (raise the refusal: the
    transaction rolls back and nothing is stored)."""
    if max_active is None:
        return
    refusal = UnfinishedCount(session, {owner}).take(owner, max_active, jobs)
    if refusal is not None:
        raise refusal


def _upstream(made: Mapping[str, list[int]], after: Sequence[str], on: str) -> tuple[Dependency, ...]:
    return tuple(
        Dependency.model_validate({"job": job_id, "on": on}) for name in after for job_id in made[name]
    )


def _store_stage(
    session: Session,
    pipeline_id: int,
    name: str,
    upstream: tuple[Dependency, ...],
    job: NewJob | None,
    sweep: NewSweep | None,
    insert_jobs: InsertJobs,
    insert_sweep: InsertSweep,
) -> tuple[int | None, int | None, list[int]]:
    """(its job's id, its sweep's id, all its jobs' ids): a stage's job, or its sweep and trials."""
    mark: dict[str, Any] = {"pipeline_id": pipeline_id, "stage": name}
    if job is not None:
        [stored] = insert_jobs(session, [replace(job, after=job.after + upstream, **mark)])
        return stored.id, None, [stored.id]
    assert sweep is not None, "a stage is a job or a sweep"
    trials = [replace(trial, after=trial.after + upstream, **mark) for trial in sweep.trials]
    accepted = insert_sweep(session, replace(sweep, trials=trials))
    assert accepted.made is not None, "a new sweep"
    return None, accepted.sweep_id, [trial.job_id for trial in accepted.made.trials]


def _current_jobs(session: Session, stages: Mapping[str, PipelineStage]) -> dict[str, list[int]]:
    """Each stage's jobs now (a sweep stage's: all its trials)."""
    made = {name: [stage.job_id] for name, stage in stages.items() if stage.job_id is not None}
    sweep_of = {stage.sweep_id: name for name, stage in stages.items() if stage.sweep_id is not None}
    if sweep_of:
        query = (
            select(Job.id, Job.sweep_id).where(col(Job.sweep_id).in_(list(sweep_of))).order_by(col(Job.id))
        )
        for job_id, sweep_id in session.exec(query):
            made.setdefault(sweep_of[sweep_id or 0], []).append(int(job_id or 0))
    return made
