"""Liveness: answers without a token, says whether the ledger can be read."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import RuntimeDep
from service.ledger.db import check_ledger

router = APIRouter(tags=["health"])


@router.get(
    "/healthz",
    summary="Is the service up?",
    responses={503: {"description": "Degraded: the ledger cannot be read (its error is in the body)."}},
)
def healthz(runtime: RuntimeDep) -> JSONResponse:
    try:
        check_ledger(runtime.engine)
    except Exception as error:  # report, never raise: this is what monitors poll
        return JSONResponse({"status": "degraded", "database": str(error)[:200]}, status_code=503)
    return JSONResponse({"status": "ok", "database": "ok", "backends": sorted(runtime.backends)})
