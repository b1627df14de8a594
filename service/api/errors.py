"""ServiceError -> HTTP. Bodies always say which field and what is wrong."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import OperationalError

from service.errors import (
    BackendError,
    Conflict,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    ServiceError,
    Unauthenticated,
    Unavailable,
)
from service.quotas import RetryLater
from service.states import IllegalTransition
from service.storage import ledger_storage_problem

log = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[ServiceError], int] = {
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    InvalidRequest: 422,
    Conflict: 409,
    LimitExceeded: 429,
    Unavailable: 503,
    BackendError: 502,
    InsufficientStorage: 507,
}
NOT_BODY_FIELDS = ("job_id", "rank", "cursor", "token_id", "user", "offset", "Idempotency-Key")


def error_body(message: str, field: str | None = None) -> dict[str, object]:
    detail: dict[str, object] = {"msg": message, "type": "value_error"}
    if field is not None:
        detail["loc"] = ["body", *field.split(".")] if field not in NOT_BODY_FIELDS else [field]
    return {"detail": [detail]}


async def _service_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ServiceError)
    status = next((code for kind, code in STATUS_BY_ERROR.items() if isinstance(error, kind)), 400)
    text = f"{error.field}: {error.message}" if error.field else error.message
    headers: dict[str, str] = {}
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(error, RetryLater):
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse(error_body(text, error.field), status_code=status, headers=headers)


async def _invalid_input(request: Request, error: Exception) -> JSONResponse:
    """FastAPI's own 422, except that it echoes NaN / Infinity inputs as text: JSON cannot hold them,
    and the stock handler fails to render them (a 500 in place of the 422)."""
    assert isinstance(error, RequestValidationError)
    return JSONResponse({"detail": _json_safe(jsonable_encoder(error.errors()))}, status_code=422)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_json_safe(item) for item in value]
    return value


async def _illegal_transition(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(error)), status_code=409)


async def _database_down(request: Request, error: Exception) -> JSONResponse:
    runtime = getattr(request.app.state, "runtime", None)
    no_room = ledger_storage_problem(error, runtime.settings if runtime is not None else None)
    if no_room is not None:  # the database answers but cannot write: retrying soon will not help
        log.warning("ledger write refused: %s", error)
        return JSONResponse(error_body(no_room), status_code=507)
    log.warning("database unavailable: %s", error)
    return JSONResponse(
        error_body("the job database is unavailable right now; try again shortly"),
        status_code=503,
        headers={"Retry-After": "2"},
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _invalid_input)
    app.add_exception_handler(IllegalTransition, _illegal_transition)
    app.add_exception_handler(OperationalError, _database_down)
