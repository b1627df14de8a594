"""/api/v1/pipelines: thin routes over service.domain.submit (creation), service.domain.pipelines
(reads, cancel) and the intake (a retry's new jobs, one transaction)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ConfigDict, Field

from service.api.deps import CurrentUser, RuntimeDep
from service.api.errors import error_responses
from service.api.routes.jobs import JSON, IdempotencyKey
from service.domain import pipelines
from service.domain.auth import Principal
from service.domain.cursors import MAX_ID
from service.ledger.db import session_scope
from service.ledger.models.pipelines import PipelineCreate, PipelinePage, PipelinePublic
from service.runtime import Runtime

router = APIRouter(prefix="/api/v1/pipelines", tags=["pipelines"])

PipelineId = Annotated[int, Path(ge=1, le=MAX_ID, description="The pipeline's id.")]


class RetryFrom(BaseModel):
    """The body of POST /api/v1/pipelines/{id}/retry."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    from_stage: str = Field(
        alias="from", min_length=1, max_length=100, description="The stage to run again, with all after it."
    )


@router.post(
    "",
    status_code=201,
    response_model=PipelinePublic,
    summary="Launch a pipeline: named stages, each a job or a sweep, run after one another",
    responses={
        200: {"model": PipelinePublic, "description": "A retry: the pipeline this Idempotency-Key made."},
        **error_responses(403, 404, 409, 413, 422, 429, 502, 507),
    },
)
async def create_pipeline(
    payload: PipelineCreate, runtime: RuntimeDep, user: CurrentUser, idempotency_key: IdempotencyKey = None
) -> Response:
    """Store the pipeline with every stage's job or sweep at once, or nothing; a stage runs once the
    stages in its `after` ended as its `on` asks (until then its jobs are `waiting`)."""
    with runtime.writers.writing():
        accepted = await runtime.admission.submit_pipeline(payload, user, idempotency_key)
    pipeline = await run_in_threadpool(_read, runtime, accepted.pipeline_id, user)
    return Response(
        pipeline.model_dump_json(), status_code=200 if accepted.replayed else 201, media_type=JSON
    )


@router.get(
    "", response_model=PipelinePage, summary="List pipelines, newest first", responses=error_responses(422)
)
def list_pipelines(
    runtime: RuntimeDep,
    user: CurrentUser,
    cursor: Annotated[
        str | None, Query(max_length=100, description="next_cursor of the page before.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=pipelines.MAX_PAGE)] = 50,
) -> PipelinePage:
    with session_scope(runtime.engine) as session:
        return pipelines.list_pipelines(session, user, limit=limit, cursor=cursor)


@router.get(
    "/{pipeline_id}",
    response_model=PipelinePublic,
    summary="One pipeline: its stages, their jobs or sweeps and states",
    responses=error_responses(404, 422),
)
def get_pipeline(pipeline_id: PipelineId, runtime: RuntimeDep, user: CurrentUser) -> PipelinePublic:
    return _read(runtime, pipeline_id, user)


@router.post(
    "/{pipeline_id}/cancel",
    response_model=PipelinePublic,
    summary="Cancel every job of the pipeline that has not ended (idempotent)",
    responses=error_responses(404, 422, 502),
)
def cancel_pipeline(pipeline_id: PipelineId, runtime: RuntimeDep, user: CurrentUser) -> PipelinePublic:
    pipelines.cancel_pipeline(runtime.engine, pipeline_id, runtime.backends, user)
    return _read(runtime, pipeline_id, user)


@router.post(
    "/{pipeline_id}/retry",
    response_model=PipelinePublic,
    summary="Run a stage again, and every stage after it (`retry --from`)",
    responses=error_responses(404, 409, 422, 429),
)
async def retry_pipeline(
    pipeline_id: PipelineId, body: RetryFrom, runtime: RuntimeDep, user: CurrentUser
) -> PipelinePublic:
    """New jobs for the stage and every stage downstream of it, in one transaction; the stages before
    it keep theirs, and the new ones run after those. 409 while any of those stages has not ended."""
    with runtime.writers.writing():
        await runtime.admission.retry_pipeline(pipeline_id, body.from_stage, user)
    return await run_in_threadpool(_read, runtime, pipeline_id, user)


def _read(runtime: Runtime, pipeline_id: int, user: Principal) -> PipelinePublic:
    with session_scope(runtime.engine) as session:
        return pipelines.get_pipeline(session, pipeline_id, user)
