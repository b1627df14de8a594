"""GET /metrics: Prometheus text format (service.api.metrics builds it)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from service.api.deps import CurrentUser
from service.api.errors import error_responses
from service.api.metrics import CONTENT_TYPE_LATEST, ServiceMetrics

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
