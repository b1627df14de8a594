"""/api/v1/code: upload a project's code snapshot, and look at one."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from service.api.deps import CurrentUser, RuntimeDep, SessionDep
from service.api.errors import error_responses
from service.ledger.models.code_snapshots import CodeSnapshotDetail, CodeSnapshotPublic
from worker.spec import CODE_ID_PATTERN

router = APIRouter(prefix="/api/v1/code", tags=["code"])

CodeId = Annotated[str, Path(pattern=CODE_ID_PATTERN, description="`sha256:<hex>`, as the upload answered.")]
ARCHIVE_BODY = {
    "requestBody": {
        "required": True,
        "description": "A .tar.gz, .tar or zip of the project folder.",
        "content": {
            kind: {"schema": {"type": "string", "format": "binary"}}
            for kind in ("application/gzip", "application/zip", "application/octet-stream")
        },
    }
}


@router.post(
    "",
    status_code=201,
    response_model=CodeSnapshotPublic,
    summary="Upload a code snapshot",
    responses={
        200: {"model": CodeSnapshotPublic, "description": "You uploaded this content before: its id."},
        **error_responses(403, 413, 422, 429, 507),
    },
    openapi_extra=ARCHIVE_BODY,
)
async def upload_code(request: Request, runtime: RuntimeDep, user: CurrentUser) -> Response:
    """Check the archive, store it once by its SHA-256, and answer its id; needs the allow-code
    permission, counts against your submissions a minute, and your snapshots together (archives and
    unpacked files) may hold TORCHYARD_MAX_CODE_BYTES_PER_USER bytes. A few uploads of yours may be in
    flight at once (429 past TORCHYARD_MAX_UPLOADS_IN_FLIGHT_PER_USER)."""
    snapshot, created = await runtime.code_uploads.upload(user, request.stream())  # read once allowed
    return Response(snapshot.model_dump_json(), status_code=201 if created else 200,
                    media_type="application/json")  # fmt: skip


@router.get(
    "/{code_id}",
    response_model=CodeSnapshotDetail,
    summary="One of your code snapshots, with its file list",
    responses=error_responses(404, 422),
)
def get_code(
    code_id: CodeId, runtime: RuntimeDep, session: SessionDep, user: CurrentUser
) -> CodeSnapshotDetail:
    return runtime.code.describe(session, user, code_id)
