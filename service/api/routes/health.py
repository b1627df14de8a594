"""Liveness: answers without a token, says whether the database answers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from service.api.deps import RuntimeDep

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    summary="Is the service up?",
    responses={503: {"description": "Degraded: the database does not answer (its error is in the body)."}},
)
def healthz(runtime: RuntimeDep) -> JSONResponse:
    try:
        with runtime.engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception as error:  # report, never raise: this is what monitors poll
        return JSONResponse({"status": "degraded", "database": str(error)[:200]}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok", "backends": sorted(runtime.backends)})
