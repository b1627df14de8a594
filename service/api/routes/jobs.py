"""/api/v1/jobs: thin routes that validate, call service.domain.jobs, and return public models."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request, Response
from fastapi.responses import PlainTextResponse
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field
from sqlmodel import SQLModel

from service.api import etag
from service.api.deps import (
    AUTHORIZATION,
    CurrentUser,
    PolledRoute,
    RuntimeDep,
    SessionDep,
    polled_route,
    read_params,
    runtime_of,
)
from service.api.errors import error_responses
from service.api.fragments import Page
from service.api.gate import principal_of
from service.api.metrics import HELD_S
from service.domain import cancel, history, jobs, logs, metric_series
from service.domain.auth import Principal
from service.domain.cursors import MAX_ID
from service.domain.metric_series import MAX_POINTS, POINTS_PER_BUCKET
from service.errors import InvalidRequest
from service.ledger.clock import LedgerVersion
from service.ledger.models.history import JobAttemptPublic, JobEventPublic
from service.ledger.models.jobs import JobCreate, JobPage, JobPublic
from service.ledger.models.metrics import JobMetricPublic, MetricSeriesPage
from service.runtime import Runtime
from service.states import JobState
from worker.spec import MAX_COUNT

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"], route_class=PolledRoute)

JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="The job's id.")]
NO_NUL = r"^[^\x00]*$"  # PostgreSQL text cannot hold NUL: refuse it here rather than fail the query
JSON = "application/json"
IF_NONE_MATCH = "An ETag from an earlier answer: 304 when nothing changed."
IfNoneMatch = Annotated[str | None, Header(description=IF_NONE_MATCH)]
# The polled routes read their parameters and two headers themselves (service.api.deps.read_params
# says why).
POLL_HEADERS = {"if_none_match": IF_NONE_MATCH, "authorization": AUTHORIZATION}
IdempotencyKey = Annotated[
    str | None,
    Header(
        min_length=1,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="Retrying with the same key returns the job the first request made, never a second.",
    ),
]
MAX_WAIT_S = 30.0  # a long poll holds a connection; clients ask again rather than wait for minutes
RECHECK_S = 1.0  # a waiting long poll reads the job again this often: other replicas do not wake it
VARY = {"Vary": "Authorization"}  # each caller sees their own jobs: a shared cache must not mix them


# What the answers promise besides their bodies, so that the schema (and a fuzzer) can hold them to it.
def _header(description: str, kind: str = "string") -> dict[str, Any]:
    return {"description": description, "required": True, "schema": {"type": kind}}


TAGGED = {"ETag": _header("Send it back as If-None-Match: 304 while nothing changed.")}
NOT_MODIFIED: dict[int | str, dict[str, Any]] = {
    304: {"description": "Unchanged since If-None-Match.", "headers": TAGGED}
}
READ_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"headers": TAGGED},
    **NOT_MODIFIED,
    **error_responses(404, 422),
}
PAGE_HEADERS = {**TAGGED, etag.SERVER_TIME_HEADER: _header("The ledger clock when the page was read.")}
LOG_HEADERS = {
    "X-Log-Size": _header("The log file's size in bytes.", "integer"),
    "X-Log-Next-Offset": _header("Where the next read should start (`offset`).", "integer"),
}


def _iso_time(value: object) -> object:
    """`since` as ISO 8601 text, as the schema says: pydantic alone would also take digits as a Unix
    time, an input no client is promised and a typo (a page size, an id) would silently become."""
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return value
        raise ValueError("must be an ISO 8601 date-time (the server_time of the last page), not a number")
    return value


def _in_utc(value: datetime | None) -> datetime | None:
    """ISO 8601 allows offsets up to ±23:59, PostgreSQL only ±15:59 (a 500 on +16:00): compare in UTC.
    A time at the calendar's edge that UTC cannot hold is that edge; no zone means UTC, as stored."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    try:
        return value.astimezone(timezone.utc)
    except OverflowError:
        return (datetime.min if value.year == 1 else datetime.max).replace(tzinfo=timezone.utc)


def _not_modified(tag: str) -> Response:
    return Response(status_code=304, headers={**etag.headers(tag), **VARY})


def _job_tag(session: SessionDep, job_id: int, user: Principal) -> str:
    return etag.for_job(job_id, jobs.job_stamp(session, job_id, user))


@router.post(
    "",
    status_code=201,
    response_model=JobPublic,
    summary="Submit a job",
    responses={
        200: {"model": JobPublic, "description": "A retry: the job this Idempotency-Key made."},
        **error_responses(404, 409, 413, 422, 429, 502, 507),
    },
)
async def create_job(
    payload: JobCreate, runtime: RuntimeDep, user: CurrentUser, idempotency_key: IdempotencyKey = None
) -> Response:
    """Store the job (state `queued`, or `waiting` while the jobs its `after` names have not ended as
    asked) and return at once; the dispatch loop hands it to the backend. 404: `after` names a job the
    caller may not see."""
    with runtime.writers.writing():
        accepted = await runtime.admission.submit(payload, user, idempotency_key)
    status = 200 if accepted.replayed else 201
    return Response(accepted.job.model_dump_json(), status_code=status, media_type=JSON)


class ListParams(BaseModel):
    state: list[JobState] | None = Field(None, description="Keep only these states.")
    name: str | None = Field(
        None,
        min_length=jobs.MIN_NAME,
        max_length=200,
        pattern=NO_NUL,
        description=f"Substring of the name, {jobs.MIN_NAME}+ characters; A-Z and a-z match alike.",
    )
    cursor: str | None = Field(None, max_length=100, description="next_cursor of the page before.")
    limit: int = Field(50, ge=1, le=jobs.MAX_PAGE)
    since: Annotated[datetime | None, BeforeValidator(_iso_time), AfterValidator(_in_utc)] = Field(
        None, description="Only jobs changed at or after this time: the server_time of the last page."
    )


@router.get(
    "",
    response_model=JobPage,
    summary="List jobs, newest first",
    responses={200: {"headers": PAGE_HEADERS}, **NOT_MODIFIED, **error_responses(422)},
    openapi_extra=polled_route("", ListParams, **POLL_HEADERS),
)
async def list_jobs(request: Request) -> Response:
    # async, with the reads inline: a 304 costs one read of the clock, a page one index query more
    # and the joining of kept renderings; only jobs changed since they were rendered (and filters,
    # which may read many rows) are read in the thread pool.
    params = read_params(request, ListParams)
    user, if_none_match = principal_of(request.scope), request.headers.get("if-none-match")
    runtime = runtime_of(request)
    await runtime.writers.before_read()
    version = await runtime.reader.clock()  # before the rows: the page may be newer, never older
    query = jobs.PageQuery(
        tuple(params.state or ()), params.name, user.owner_filter(), params.cursor, params.limit, params.since
    )
    page = await runtime.pages.joined(query, version, functools.partial(_join_page, runtime, query, version))
    if etag.matches(if_none_match, page.tag):
        return _not_modified(page.tag)
    headers = {**etag.headers(page.tag, version.stamped_at), **VARY}
    return Response(page.body, media_type=JSON, headers=headers)


async def _join_page(runtime: Runtime, query: jobs.PageQuery, version: LedgerVersion) -> Page:
    index = await runtime.reader.page_index(query)
    parts = runtime.fragments.collect(index)
    missing = parts.missing()
    if missing:  # rendered on the event loop: the first poll to meet a change renders it, later ones find it
        runtime.fragments.complete(parts, await runtime.reader.jobs(missing))
    return Page(etag.for_page(query, index), parts.join(version.stamped_at))


class JobParams(BaseModel):
    job_id: int = Field(ge=1, le=MAX_ID, description="The job's id.")
    wait_s: float = Field(
        0,
        ge=0,
        le=MAX_WAIT_S,
        description="With an If-None-Match that is still current: wait up to this long for the job "
        "to change (state, progress, metrics, ...) and answer as soon as it does; 304 if it did not.",
    )


@router.get(
    "/{job_id}",
    response_model=JobPublic,
    summary="One job",
    responses={**READ_RESPONSES, **error_responses(404, 422, 429)},
    openapi_extra=polled_route("/{job_id}", JobParams, **POLL_HEADERS),
)
async def get_job(request: Request) -> Response:
    """The job. A long poll (`wait_s` with `If-None-Match`) answers within milliseconds of a change,
    without the caller asking again and again; a change made by another replica is seen within
    about a second."""
    params = read_params(request, JobParams)
    job_id, wait_s = params.job_id, params.wait_s
    user, if_none_match = principal_of(request.scope), request.headers.get("if-none-match")
    runtime = runtime_of(request)
    await runtime.writers.before_read()
    if wait_s <= 0 or if_none_match is None:  # not a long poll: one read
        return await _job_answer(runtime, job_id, user, if_none_match)
    deadline = time.monotonic() + wait_s
    # Registered before the read, so no change can slip between them.
    with runtime.job_watch.watching(job_id, user.user) as change:
        while True:
            answer = await _job_answer(runtime, job_id, user, if_none_match)
            remaining = deadline - time.monotonic()
            if answer.status_code != 304 or remaining <= 0:
                return answer
            held = time.monotonic()
            await change.wait(min(remaining, RECHECK_S))
            # The latency metric is the service's work, not the time the caller asked it to wait.
            request.scope[HELD_S] = request.scope.get(HELD_S, 0.0) + time.monotonic() - held


async def _job_answer(runtime: Runtime, job_id: int, user: Principal, if_none_match: str | None) -> Response:
    """All on the event loop: the job's stamp decides a 304 and finds a kept rendering; only a job
    changed since it was last rendered is read whole and rendered (by the first poll to meet it)."""
    stamp = await runtime.reader.job_stamp(job_id, user)
    tag = etag.for_job(job_id, stamp)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    body = runtime.fragments.get(job_id, stamp)
    if body is None:  # the tag names the version rendered, which may be newer than the stamp read
        stamp, body = runtime.fragments.render(await runtime.reader.job(job_id, user))
        tag = etag.for_job(job_id, stamp)
    return Response(body, media_type=JSON, headers={**etag.headers(tag), **VARY})


@router.get(
    "/{job_id}/events",
    response_model=list[JobEventPublic],
    summary="State history",
    responses=READ_RESPONSES,
)
def get_events(
    job_id: JobId, session: SessionDep, user: CurrentUser, if_none_match: IfNoneMatch = None
) -> Response:
    tag = _job_tag(session, job_id, user)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    rows = history.list_events(session, job_id, user)
    events = [JobEventPublic.model_validate(row, from_attributes=True) for row in rows]
    return Response(dump_list(events), media_type=JSON, headers={**etag.headers(tag), **VARY})


@router.get(
    "/{job_id}/attempts",
    response_model=list[JobAttemptPublic],
    summary="Attempts: how each ended, where it ran",
    responses=READ_RESPONSES,
)
def get_attempts(
    job_id: JobId, session: SessionDep, user: CurrentUser, if_none_match: IfNoneMatch = None
) -> Response:
    """Every attempt, the first first, the current one last: a retry (the job's retry policy) or a
    requeue after preemption starts a new one."""
    tag = _job_tag(session, job_id, user)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    attempts = history.list_attempts(session, job_id, user)
    return Response(dump_list(attempts), media_type=JSON, headers={**etag.headers(tag), **VARY})


@router.get(
    "/{job_id}/metrics",
    response_model=list[JobMetricPublic] | MetricSeriesPage,
    summary="Reported metrics: every row, or each series downsampled",
    responses=READ_RESPONSES,
)
def get_metrics(
    job_id: JobId,
    session: SessionDep,
    user: CurrentUser,
    name: Annotated[str | None, Query(max_length=100, pattern=NO_NUL)] = None,
    after_step: Annotated[
        int | None, Query(ge=-1, le=MAX_COUNT, description="Only steps after this one.")
    ] = None,
    points: Annotated[
        int | None,
        Query(
            ge=POINTS_PER_BUCKET,
            le=MAX_POINTS,
            description="Instead of every row: each series (metric and attempt) in at most this many "
            "points, the first, lowest, highest and last of each slice of steps (a chart asks for about "
            "its width in pixels).",
        ),
    ] = None,
    from_step: Annotated[
        int | None, Query(ge=0, le=MAX_COUNT, description="With points: the first step to show.")
    ] = None,
    to_step: Annotated[
        int | None, Query(ge=0, le=MAX_COUNT, description="With points: the last step to show.")
    ] = None,
    if_none_match: IfNoneMatch = None,
) -> Response:
    if points is None and (from_step is not None or to_step is not None):
        raise InvalidRequest("from_step and to_step need points", field="points")
    tag = _job_tag(session, job_id, user)
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)
    headers = {**etag.headers(tag), **VARY}
    if points is not None:
        page = metric_series.read_series(
            session, job_id, user, points=points, from_step=from_step, to_step=to_step
        )
        return Response(page.model_dump_json(), media_type=JSON, headers=headers)
    rows = history.list_metrics(session, job_id, user, name=name, after_step=after_step)
    metrics = [JobMetricPublic.model_validate(row, from_attributes=True) for row in rows]
    return Response(dump_list(metrics), media_type=JSON, headers=headers)


def dump_list(items: Sequence[SQLModel]) -> bytes:
    """A JSON array of public models, each rendered once (no list model built around them)."""
    return b"[" + b",".join(item.model_dump_json().encode() for item in items) + b"]"


@router.get(
    "/{job_id}/logs",
    response_class=PlainTextResponse,
    summary="One rank's log (plain text)",
    responses={200: {"headers": LOG_HEADERS}, **error_responses(404, 422, json_route=False)},
)
def get_logs(
    job_id: JobId,
    session: SessionDep,
    runtime: RuntimeDep,
    user: CurrentUser,
    rank: Annotated[int, Query(ge=0, le=100_000)] = 0,
    tail: Annotated[int | None, Query(ge=0, le=100_000, description="Last N lines.")] = None,
    stream: Annotated[str, Query(pattern="^(out|err)$", description="stdout or stderr.")] = "out",
    offset: Annotated[
        int | None,
        Query(ge=0, le=2**62, description="Read from this byte on (X-Log-Next-Offset of the last read)."),
    ] = None,
) -> PlainTextResponse:
    """At most `max_log_bytes` of one rank's log: its end, or the bytes from `offset` on.

    X-Log-Size is the file's size and X-Log-Next-Offset where the next read should start: a follower
    reads from 0 (or from the size) on and never holds more than one window in memory.
    """
    job = jobs.get_job(session, job_id, user)
    backend = jobs.require_backend(runtime.backends, job.backend)
    window = logs.read_log(
        job,
        backend,
        rank=rank,
        tail=tail,
        stream=stream,
        max_bytes=runtime.settings.max_log_bytes,
        offset=offset,
    )
    headers = {"X-Log-Size": str(window.size), "X-Log-Next-Offset": str(window.end)}
    return PlainTextResponse(window.text, headers=headers)


@router.post(
    "/{job_id}/cancel",
    response_model=JobPublic,
    summary="Cancel (idempotent)",
    responses=error_responses(404, 409, 422, 502),
)
def cancel_job(job_id: JobId, runtime: RuntimeDep, user: CurrentUser) -> Response:
    job = cancel.cancel_job(runtime.engine, job_id, runtime.backends, user)
    return Response(JobPublic.model_validate(job, from_attributes=True).model_dump_json(), media_type=JSON)
