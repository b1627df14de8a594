"""The pipeline domain: read, list and cancel pipelines; an Idempotency-Key's pipeline. The caller owns
the transaction (cancel has its own: it calls the scheduler between them).

Creation is admission (service.domain.pipeline_admission) and the intake (one transaction for the
pipeline, its stages and their jobs and sweeps); a `retry --from` is planned by
service.domain.pipeline_retry and stored by the intake too. Its state is decided as its jobs end
(service.domain.pipeline_state); a stage's jobs are ordinary jobs with `pipeline_id` and `stage`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select as core_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.backends.base import Backend
from service.domain import audit
from service.domain.auth import Principal
from service.domain.cancel import cancel_jobs
from service.domain.cursors import decode_cursor, encode_cursor
from service.domain.pipeline_state import read_stages
from service.errors import Conflict, NotFound
from service.ledger.db import write_scope
from service.ledger.models.jobs import Job
from service.ledger.models.pipelines import (
    Pipeline,
    PipelineAccepted,
    PipelinePage,
    PipelinePublic,
    PipelineStage,
    StagePublic,
)
from service.states import JobState, is_terminal

MAX_PAGE = 200


def get_pipeline_row(session: Session, pipeline_id: int, viewer: Principal) -> Pipeline:
    """The pipeline, if it exists and `viewer` may see it; another user's is as missing as none."""
    pipeline = session.get(Pipeline, pipeline_id)
    if pipeline is None or not viewer.may_see(pipeline.owner):
        raise NotFound(f"pipeline {pipeline_id} not found", field="pipeline_id")
    return pipeline


def get_pipeline(session: Session, pipeline_id: int, viewer: Principal) -> PipelinePublic:
    """The pipeline with its stages and their states."""
    pipeline = get_pipeline_row(session, pipeline_id, viewer)
    return public(session, [pipeline])[0]


def list_pipelines(
    session: Session, viewer: Principal, *, limit: int = 50, cursor: str | None = None
) -> PipelinePage:
    """The viewer's pipelines (an admin's: everyone's), newest first, with their stages."""
    query = select(Pipeline).order_by(col(Pipeline.id).desc()).limit(limit + 1)
    if (owner := viewer.owner_filter()) is not None:
        query = query.where(col(Pipeline.owner) == owner)
    if cursor is not None:
        query = query.where(col(Pipeline.id) < decode_cursor(cursor))
    rows = list(session.exec(query).all())
    more = len(rows) > limit
    rows = rows[:limit]
    next_cursor = encode_cursor(rows[-1].id or 0) if more and rows else None
    return PipelinePage(items=public(session, rows), next_cursor=next_cursor)


def public(session: Session, pipelines: Sequence[Pipeline]) -> list[PipelinePublic]:
    """These pipelines as readers see them: two reads for their stages, however many."""
    stages = read_stages(session, [pipeline.id for pipeline in pipelines if pipeline.id is not None])
    return [
        PipelinePublic(
            id=pipeline.id or 0,
            name=pipeline.name,
            owner=pipeline.owner,
            state=_state(pipeline.state),
            reason=pipeline.reason,
            created_at=pipeline.created_at,
            updated_at=pipeline.updated_at,
            finished_at=pipeline.finished_at,
            stages=[
                StagePublic(
                    name=stage.name,
                    position=stage.position,
                    kind="sweep" if stage.sweep_id is not None else "job",
                    after=list(stage.after),
                    on=_on(stage.on),
                    job_id=stage.job_id,
                    sweep_id=stage.sweep_id,
                    state=outcome.state,
                    reason=outcome.reason,
                    runs=stage.runs,
                )
                for stage, outcome in stages.get(pipeline.id or 0, [])
            ],
        )
        for pipeline in pipelines
    ]


def find_replayed(session: Session, owner: str, key: str) -> Pipeline | None:
    """The pipeline an earlier request of `owner` with this Idempotency-Key made."""
    query = select(Pipeline).where(col(Pipeline.owner) == owner, col(Pipeline.idempotency_key) == key)
    return session.exec(query).first()


def replay_pipeline(earlier: Pipeline, request: dict[str, Any]) -> PipelineAccepted:
    """The answer to a retry of the request that made `earlier`; Conflict when it is another request."""
    if earlier.request != request:
        raise Conflict(
            f"this Idempotency-Key was already used for a different pipeline (pipeline {earlier.id})",
            field="Idempotency-Key",
        )
    assert earlier.id is not None
    return PipelineAccepted(earlier.id, replayed=True)


def cancel_pipeline(
    engine: Engine, pipeline_id: int, backends: Mapping[str, Backend], viewer: Principal
) -> None:
    """Cancel every job of the pipeline that has not ended (those waiting end at once), with one
    scheduler call per backend (service.domain.cancel); the pipeline ends cancelled as the last of
    them does (service.domain.pipeline_state). Idempotent: an ended pipeline stays as it ended."""
    with Session(engine) as session:
        pipeline = get_pipeline_row(session, pipeline_id, viewer)
        query = core_select(col(Job.id), col(Job.state)).where(col(Job.pipeline_id) == pipeline_id)
        unfinished = [job_id for job_id, state in session.execute(query) if not is_terminal(JobState(state))]
        owner = pipeline.owner
    if unfinished:
        cancel_jobs(engine, sorted(unfinished), backends, viewer)
    with write_scope(engine) as session:
        audit.record(
            session, viewer.user, "pipeline.cancel", f"pipeline {pipeline_id}",
            f"owner={owner} jobs={len(unfinished)}",
        )  # fmt: skip


def stage_rows(session: Session, pipeline_id: int) -> list[PipelineStage]:
    """Its stages, in the order given, locked for a retry's change."""
    query = (
        select(PipelineStage)
        .where(col(PipelineStage.pipeline_id) == pipeline_id)
        .order_by(col(PipelineStage.position))
        .with_for_update()
    )
    return list(session.exec(query).all())


def _state(value: str) -> Any:
    return value  # one of PipelineState: only pipeline_state writes it


def _on(value: str) -> Any:
    return value  # one of DependsOn: only the store writes it, from a checked request
