"""/api/v1/sweeps: thin routes over service.domain.submit (creation) and service.domain.sweeps."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from fastapi.concurrency import run_in_threadpool

from service.api import etag
from service.api.deps import CurrentUser, RuntimeDep
from service.api.errors import error_responses
from service.api.routes.jobs import (
    JSON,
    NOT_MODIFIED,
    TAGGED,
    VARY,
    IdempotencyKey,
    IfNoneMatch,
    _not_modified,
)
from service.domain import sweep_resume, sweeps
from service.domain.auth import Principal
from service.domain.cursors import MAX_ID
from service.ledger.db import session_scope
from service.ledger.models.sweeps import SweepCreate, SweepPage, SweepPublic
from service.runtime import Runtime

router = APIRouter(prefix="/api/v1/sweeps", tags=["sweeps"])

SweepId = Annotated[int, Path(ge=1, le=MAX_ID, description="The sweep's id.")]


@router.post(
    "",
    status_code=201,
    response_model=SweepPublic,
    summary="Launch a sweep: every combination of the grid is a trial job",
    responses={
        200: {"model": SweepPublic, "description": "A retry: the sweep this Idempotency-Key made."},
        **error_responses(403, 404, 409, 413, 422, 429, 502, 507),
    },
)
async def create_sweep(
    payload: SweepCreate, runtime: RuntimeDep, user: CurrentUser, idempotency_key: IdempotencyKey = None
) -> Response:
    """Store the sweep and all its trials at once (each `queued`); on SLURM they go out as one job
    array, throttled to `max_parallel`."""
    with runtime.writers.writing():  # polls wait while it is admitted, as for a job's POST
        accepted = await runtime.admission.submit_sweep(payload, user, idempotency_key)
    sweep = accepted.made
    if sweep is None:  # a replay: the sweep as it is now
        sweep = await run_in_threadpool(_read, runtime, accepted.sweep_id, user)
    return Response(sweep.model_dump_json(), status_code=200 if accepted.replayed else 201, media_type=JSON)


@router.get(
    "",
    response_model=SweepPage,
    summary="List sweeps, newest first",
    responses={200: {"headers": TAGGED}, **NOT_MODIFIED, **error_responses(422)},
)
async def list_sweeps(
    runtime: RuntimeDep,
    user: CurrentUser,
    cursor: Annotated[
        str | None, Query(max_length=100, description="next_cursor of the page before.")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=sweeps.MAX_PAGE)] = 50,
    if_none_match: IfNoneMatch = None,
) -> Response:
    tag = etag.for_ledger(await runtime.reader.clock(), f"sweeps.{user.owner_filter() or '*'}")
    if etag.matches(if_none_match, tag):
        return _not_modified(tag)

    def page() -> SweepPage:
        with session_scope(runtime.engine) as session:
            return sweeps.list_sweeps(session, user, limit=limit, cursor=cursor)

    body = (await run_in_threadpool(page)).model_dump_json()
    return Response(body, media_type=JSON, headers={**etag.headers(tag), **VARY})


@router.get(
    "/{sweep_id}",
    response_model=SweepPublic,
    summary="One sweep: its trials, their metric, the best trial",
    responses={200: {"headers": TAGGED}, **NOT_MODIFIED, **error_responses(404, 422)},
)
async def get_sweep(
    sweep_id: SweepId, runtime: RuntimeDep, user: CurrentUser, if_none_match: IfNoneMatch = None
) -> Response:
    # The ledger clock moves with every trial's change (state, progress, metrics): one cheap read.
    tag = etag.for_ledger(await runtime.reader.clock(), f"sweep{sweep_id}.{user.user}")
    if etag.matches(if_none_match, tag):
        await run_in_threadpool(_check_visible, runtime, sweep_id, user)  # 404 stays 404
        return _not_modified(tag)
    sweep = await run_in_threadpool(_read, runtime, sweep_id, user)
    return Response(sweep.model_dump_json(), media_type=JSON, headers={**etag.headers(tag), **VARY})


@router.post(
    "/{sweep_id}/cancel",
    response_model=SweepPublic,
    summary="Cancel every unfinished trial (idempotent)",
    responses=error_responses(404, 422, 502),
)
def cancel_sweep(sweep_id: SweepId, runtime: RuntimeDep, user: CurrentUser) -> Response:
    sweeps.cancel_sweep(runtime.engine, sweep_id, runtime.backends, user)
    sweep = _read(runtime, sweep_id, user)
    return Response(sweep.model_dump_json(), media_type=JSON)


@router.post(
    "/{sweep_id}/trials/{number}/resume",
    status_code=201,
    response_model=SweepPublic,
    summary="Continue a trial early_stop stopped, to the end, from its latest checkpoint (a new job)",
    responses=error_responses(404, 409, 422, 429),
)
def resume_trial(
    sweep_id: SweepId,
    number: Annotated[int, Path(ge=0, le=MAX_ID, description="The trial's number (N of 'sweep[N]').")],
    runtime: RuntimeDep,
    user: CurrentUser,
) -> Response:
    """409 naming the trial when it was not stopped early (service.domain.sweep_resume)."""
    sweep_resume.resume_trial(
        runtime.engine, runtime.settings, sweep_id, number, user, runtime.intake.insert_trials
    )
    runtime.dispatcher.wake()
    sweep = _read(runtime, sweep_id, user)
    return Response(sweep.model_dump_json(), status_code=201, media_type=JSON)


def _read(runtime: Runtime, sweep_id: int, user: Principal) -> SweepPublic:
    with session_scope(runtime.engine) as session:
        return sweeps.get_sweep(session, sweep_id, user)


def _check_visible(runtime: Runtime, sweep_id: int, user: Principal) -> None:
    with session_scope(runtime.engine) as session:
        sweeps.get_sweep_row(session, sweep_id, user)
