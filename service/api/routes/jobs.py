"""/api/v1/jobs: thin routes that validate, call service.jobs, and return public models."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse

from service import jobs
from service.api.deps import RuntimeDep, SessionDep
from service.models import JobCreate, JobEventPublic, JobMetricPublic, JobPage, JobPublic
from service.states import JobState
from worker.spec import RunSpec

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])

JobId = Annotated[int, Path(ge=1, description="The job's id.")]
JSON = "application/json"


@router.post("", status_code=201, response_model=JobPublic, summary="Submit a job")
async def create_job(payload: JobCreate, runtime: RuntimeDep) -> Response:
    """Store the job (state `queued`) and return at once; the dispatch loop hands it to the backend."""
    backend_name = jobs.check_request(payload, runtime.settings)
    backend = jobs.require_backend(runtime.backends, backend_name)
    probe = RunSpec(job_id=0, name=payload.name, folder="", **payload.model_dump(exclude={"name", "backend"}))
    await run_in_threadpool(backend.validate, probe)
    public = await runtime.intake.add(jobs.new_job_row(payload, "anonymous", backend_name))
    return Response(public.model_dump_json(), status_code=201, media_type=JSON)


@router.get("", response_model=JobPage, summary="List jobs, newest first")
def list_jobs(
    session: SessionDep,
    state: Annotated[list[JobState] | None, Query(description="Keep only these states.")] = None,
    name: Annotated[str | None, Query(max_length=200, description="Substring of the name.")] = None,
    cursor: Annotated[
        str | None, Query(max_length=100, description="next_cursor of the page before.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=jobs.MAX_PAGE)] = 50,
    since: Annotated[datetime | None, Query(description="Only jobs changed at or after this time.")] = None,
) -> Response:
    page = jobs.list_jobs(
        session, state=state or (), name=name, cursor=cursor, limit=limit, updated_since=since
    )
    return Response(page.model_dump_json(), media_type=JSON)


@router.get("/{job_id}", response_model=JobPublic, summary="One job")
def get_job(job_id: JobId, session: SessionDep) -> Response:
    job = JobPublic.model_validate(jobs.get_job(session, job_id), from_attributes=True)
    return Response(job.model_dump_json(), media_type=JSON)


@router.get("/{job_id}/events", response_model=list[JobEventPublic], summary="State history")
def get_events(job_id: JobId, session: SessionDep) -> list[JobEventPublic]:
    return [JobEventPublic.model_validate(e, from_attributes=True) for e in jobs.list_events(session, job_id)]


@router.get("/{job_id}/metrics", response_model=list[JobMetricPublic], summary="Reported metrics")
def get_metrics(
    job_id: JobId,
    session: SessionDep,
    name: Annotated[str | None, Query(max_length=100)] = None,
    after_step: Annotated[int | None, Query(ge=-1, description="Only steps after this one.")] = None,
) -> list[JobMetricPublic]:
    rows = jobs.list_metrics(session, job_id, name=name, after_step=after_step)
    return [JobMetricPublic.model_validate(row, from_attributes=True) for row in rows]


@router.get("/{job_id}/logs", response_class=PlainTextResponse, summary="One rank's log (plain text)")
def get_logs(
    job_id: JobId,
    session: SessionDep,
    runtime: RuntimeDep,
    rank: Annotated[int, Query(ge=0, le=100_000)] = 0,
    tail: Annotated[int | None, Query(ge=0, le=100_000, description="Last N lines.")] = None,
    stream: Annotated[str, Query(pattern="^(out|err)$", description="stdout or stderr.")] = "out",
) -> PlainTextResponse:
    job = jobs.get_job(session, job_id)
    backend = jobs.require_backend(runtime.backends, job.backend)
    text = jobs.read_log(
        job, backend, rank=rank, tail=tail, stream=stream, max_bytes=runtime.settings.max_log_bytes
    )
    return PlainTextResponse(text)


@router.post("/{job_id}/cancel", response_model=JobPublic, summary="Cancel (idempotent)")
def cancel_job(job_id: JobId, session: SessionDep, runtime: RuntimeDep) -> Response:
    job = jobs.cancel_job(session, job_id, runtime.backends)
    session.commit()
    return Response(JobPublic.model_validate(job, from_attributes=True).model_dump_json(), media_type=JSON)
