"""GET /metrics: Prometheus text format (service.api.metrics builds it); GET /api/v1/folders: the
largest job folders, for admins (/metrics gives only totals: any token may read it)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request, Response

from service.api.deps import AdminUser, CurrentUser, SessionDep
from service.api.errors import error_responses
from service.api.metrics import CONTENT_TYPE_LATEST, ServiceMetrics
from service.domain import retention
from service.ledger.models.jobs import JobFolderPublic

router = APIRouter(tags=["monitoring"])


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses=error_responses(json_route=False),
)
def prometheus(request: Request, user: CurrentUser) -> Response:
    """Any valid token may read these: they count jobs by state and backend, never name them."""
    metrics: ServiceMetrics = request.app.state.metrics
    return Response(metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


@router.get(
    "/api/v1/folders",
    response_model=list[JobFolderPublic],
    summary="The largest job folders on disk (admins)",
    responses=error_responses(422),
)
def largest_folders(
    session: SessionDep,
    admin: AdminUser,
    limit: Annotated[int, Query(ge=1, le=retention.MAX_LARGEST, description="How many.")] = 20,
) -> list[JobFolderPublic]:
    """Largest first, as the housekeeping loop last measured them (a folder not measured yet is left
    out): what fills the data directory, and whose."""
    found = retention.largest_folders(session, limit)
    return [JobFolderPublic.model_validate(job, from_attributes=True) for job in found]
