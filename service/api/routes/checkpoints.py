"""/api/v1/jobs/{id}/checkpoints: a job's checkpoints, listed a page at a time and downloaded, streamed
(service.domain.checkpoints, which reads the folder the job wrote through service.jobfs)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Literal

from fastapi import APIRouter, Path, Query, Response
from fastapi.responses import StreamingResponse

from service.api.deps import CurrentUser, SessionDep
from service.api.errors import error_responses
from service.api.routes.jobs import JSON, VARY, JobId, dump_list
from service.domain import checkpoints
from service.ledger.models.jobs import CheckpointPublic

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"])

CHECKPOINT_NAME = r"^ckpt-\d+\.pt$"
CHECKPOINT_HEADERS = {
    "X-Next-After": {
        "description": "More follow: pass this name as `after` for the next page (absent on the last).",
        "schema": {"type": "string"},
    },
    "X-Listing-Cut": {
        "description": "The folder holds more names than one request reads: only its first this many "
        "(in the folder's own order, not by step) were looked at.",
        "schema": {"type": "integer"},
    },
}


@router.get(
    "/{job_id}/checkpoints",
    response_model=list[CheckpointPublic],
    summary="Rank 0's checkpoints, a page at a time",
    responses={200: {"headers": CHECKPOINT_HEADERS}, **error_responses(404, 422)},
)
def get_checkpoints(
    job_id: JobId,
    session: SessionDep,
    user: CurrentUser,
    limit: Annotated[
        int, Query(ge=1, le=checkpoints.MAX_PAGE, description="The most checkpoints on this page.")
    ] = checkpoints.DEFAULT_PAGE,
    after: Annotated[
        str | None,
        Query(max_length=255, pattern=CHECKPOINT_NAME, description="X-Next-After of the page before."),
    ] = None,
    order: Annotated[
        Literal["oldest", "newest"], Query(description="Oldest first (by step), or newest first.")
    ] = "oldest",
) -> Response:
    """The checkpoints the job folder holds now: what the job's checkpoint policy kept (none once
    retention removed them). A page at a time: a job could fill its folder with names."""
    page = checkpoints.list_checkpoints(
        session, job_id, user, limit=limit, after=after, newest_first=order == "newest"
    )
    headers = dict(VARY)
    if page.next_after is not None:
        headers["X-Next-After"] = page.next_after
    if page.cut_at is not None:
        headers["X-Listing-Cut"] = str(page.cut_at)
    return Response(dump_list(page.items), media_type=JSON, headers=headers)


CHUNK_BYTES = 1024 * 1024


@router.get(
    "/{job_id}/checkpoints/{checkpoint}",
    response_class=StreamingResponse,
    summary="Download one checkpoint",
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "The file, streamed."},
        **error_responses(404, 422, json_route=False),
    },
)
def download_checkpoint(
    job_id: JobId,
    session: SessionDep,
    user: CurrentUser,
    checkpoint: Annotated[
        str, Path(max_length=100, pattern=CHECKPOINT_NAME, description="A name from the list.")
    ],
) -> StreamingResponse:
    """The file as it is on disk, a chunk at a time (a checkpoint may be many gigabytes)."""
    found = checkpoints.open_checkpoint(session, job_id, user, checkpoint)

    def chunks() -> Iterator[bytes]:
        with found.handle:
            while chunk := found.handle.read(CHUNK_BYTES):
                yield chunk

    headers = {
        "Content-Length": str(found.size),
        "Content-Disposition": f'attachment; filename="{found.name}"',
        **VARY,
    }
    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)
