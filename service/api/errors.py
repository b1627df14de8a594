"""ServiceError -> HTTP. Bodies always say which field and what is wrong."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from service.errors import (
    BackendError,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    ServiceError,
    Unavailable,
)
from service.states import IllegalTransition

log = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[ServiceError], int] = {
    NotFound: 404,
    InvalidRequest: 422,
    Conflict: 409,
    LimitExceeded: 429,
    Unavailable: 503,
    BackendError: 502,
}


def error_body(message: str, field: str | None = None) -> dict[str, object]:
    detail: dict[str, object] = {"msg": message, "type": "value_error"}
    if field is not None:
        detail["loc"] = ["body", *field.split(".")] if field not in ("job_id", "rank", "cursor") else [field]
    return {"detail": [detail]}


async def _service_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ServiceError)
    status = next((code for kind, code in STATUS_BY_ERROR.items() if isinstance(error, kind)), 400)
    text = f"{error.field}: {error.message}" if error.field else error.message
    return JSONResponse(error_body(text, error.field), status_code=status)


async def _illegal_transition(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(error)), status_code=409)


async def _database_down(request: Request, error: Exception) -> JSONResponse:
    log.warning("database unavailable: %s", error)
    return JSONResponse(
        error_body("the job database is unavailable right now; try again shortly"),
        status_code=503,
        headers={"Retry-After": "2"},
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(IllegalTransition, _illegal_transition)
    app.add_exception_handler(OperationalError, _database_down)
