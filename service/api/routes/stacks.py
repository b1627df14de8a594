"""/api/v1/jobs/{id}/stacks: every rank's stacks, captured now from a running job or the last capture
kept (service.domain.capture). Its owner and admins only: stacks can hold data from the job's memory.
An async route: the capture runs on the Runtime's capture threads (service.domain.captures) and is
awaited here, so no API thread waits on a job's ranks."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from service.api.deps import CurrentUser, RuntimeDep
from service.api.errors import error_responses
from service.api.routes.jobs import JSON, VARY, JobId
from service.ledger.models.stacks import StackCapturePublic

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])


@router.get(
    "/{job_id}/stacks",
    response_model=StackCapturePublic,
    summary="Every rank's stacks: captured now, or the last capture",
    responses=error_responses(404, 409, 422, 429),
)
async def get_stacks(
    job_id: JobId,
    runtime: RuntimeDep,
    user: CurrentUser,
    capture_now: Annotated[
        bool | None,
        Query(
            alias="capture",
            description="Capture now (the default for a running job; a few seconds at most), or "
            "answer the last capture kept (the default for any other job).",
        ),
    ] = None,
) -> Response:
    """The stack of every thread of every rank, ranks with the same stack in one group (the odd ranks
    first), each rank's host, and a one-line summary. 409 when the job is not running and has none,
    or when the capture did not end within its deadline (Retry-After); 429 past the captures a user
    may have under way or requests waiting (Retry-After)."""
    found = await runtime.captures.job_stacks(job_id, user, capture_now)
    return Response(found.model_dump_json(), media_type=JSON, headers=dict(VARY))
