"""/api/v1/jobs: thin routes that validate, call service.jobs, and return public models."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import PlainTextResponse
from sqlmodel import Session

from service import etag, jobs
from service.api.deps import RuntimeDep, SessionDep
from service.ledger_clock import LedgerVersion
from service.models import JobCreate, JobEventPublic, JobMetricPublic, JobPage, JobPublic
from service.runtime import Runtime
from service.states import JobState
from worker.spec import RunSpec

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])

JobId = Annotated[int, Path(ge=1, le=jobs.MAX_ID, description="The job's id.")]
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL: refuse it here rather than fail the query
JSON = "application/json"
IfNoneMatch = Annotated[
    str | None, Header(description="An ETag from an earlier answer: 304 when nothing changed.")
]


def _not_modified(tag: str) -> Response:
    return Response(status_code=304, headers=etag.headers(tag))


def _job_tag(session: SessionDep, job_id: int) -> str:
    return etag.for_job(job_id, jobs.job_stamp(session, job_id))


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
async def list_jobs(
    runtime: RuntimeDep,
    state: Annotated[list[JobState] | None, Query(description="Keep only these states.")] = None,
    name: Annotated[
        str | None, Query(max_length=200, pattern=NO_NUL, description="Substring of the name.")
    ] = None,
    cursor: Annotated[
        str | None, Query(max_length=100, description="next_cursor of the page before.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=jobs.MAX_PAGE)] = 50,
    since: Annotated[
        datetime | None,
        Query(description="Only jobs changed at or after this time: the server_time of the last page."),
    ] = None,
    if_none_match: IfNoneMatch = None,
) -> Response:
    # async with the clock read inline: it is one primary-key read, cheaper than a thread hop; only
    # a page not rendered for this clock value goes to the thread pool.
    version = runtime.clock.read()  # before the rows: the tag may be older, never newer
    tag = etag.for_ledger(version)
    headers = etag.headers(tag, version.stamped_at)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    key = (tag, tuple(state or ()), name, cursor, limit, since)
    body = runtime.pages.get(key)
    if body is None:
        body = await run_in_threadpool(_render_page, runtime, key, version)
    return Response(body, media_type=JSON, headers=headers)


def _render_page(runtime: Runtime, key: tuple[Any, ...], version: LedgerVersion) -> bytes:
    _, state, name, cursor, limit, since = key
    with Session(runtime.engine) as session:
        page = jobs.list_jobs(
            session, state=state, name=name, cursor=cursor, limit=limit, updated_since=since, as_of=version
        )
    body = page.model_dump_json().encode()
    runtime.pages.put(key, body)
    return body


@router.get("/{job_id}", response_model=JobPublic, summary="One job")
def get_job(job_id: JobId, session: SessionDep, if_none_match: IfNoneMatch = None) -> Response:
    tag = _job_tag(session, job_id)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    job = JobPublic.model_validate(jobs.get_job(session, job_id), from_attributes=True)
    return Response(job.model_dump_json(), media_type=JSON, headers=etag.headers(tag))


@router.get("/{job_id}/events", response_model=list[JobEventPublic], summary="State history")
def get_events(job_id: JobId, session: SessionDep, if_none_match: IfNoneMatch = None) -> Response:
    tag = _job_tag(session, job_id)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    rows = jobs.list_events(session, job_id)
    events = [JobEventPublic.model_validate(row, from_attributes=True) for row in rows]
    return Response(_dump(events), media_type=JSON, headers=etag.headers(tag))


@router.get("/{job_id}/metrics", response_model=list[JobMetricPublic], summary="Reported metrics")
def get_metrics(
    job_id: JobId,
    session: SessionDep,
    name: Annotated[str | None, Query(max_length=100, pattern=NO_NUL)] = None,
    after_step: Annotated[
        int | None, Query(ge=-1, le=2**31 - 1, description="Only steps after this one.")
    ] = None,
    if_none_match: IfNoneMatch = None,
) -> Response:
    tag = _job_tag(session, job_id)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    rows = jobs.list_metrics(session, job_id, name=name, after_step=after_step)
    metrics = [JobMetricPublic.model_validate(row, from_attributes=True) for row in rows]
    return Response(_dump(metrics), media_type=JSON, headers=etag.headers(tag))


def _dump(items: list[JobEventPublic] | list[JobMetricPublic]) -> bytes:
    return b"[" + b",".join(item.model_dump_json().encode() for item in items) + b"]"


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
