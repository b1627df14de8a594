"""ServiceError -> HTTP. Bodies always say which field and what is wrong."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from service.config import Settings
from service.domain.quotas import RetryLater
from service.domain.storage import ledger_storage_problem
from service.errors import (
    BackendError,
    Busy,
    Conflict,
    Forbidden,
    InsufficientStorage,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    ServiceError,
    TooLarge,
    Unauthenticated,
    Unavailable,
)
from service.states import IllegalTransition
from worker.spec import storable

log = logging.getLogger(__name__)

STATUS_BY_ERROR: dict[type[ServiceError], int] = {
    Unauthenticated: 401,
    Forbidden: 403,
    NotFound: 404,
    InvalidRequest: 422,
    Conflict: 409,
    TooLarge: 413,
    LimitExceeded: 429,
    BackendError: 502,
    InsufficientStorage: 507,
    Unavailable: 503,
}
NOT_BODY_FIELDS = (
    "job_id",
    "pipeline_id",
    "subscription_id",
    "checkpoint",
    "rank",
    "cursor",
    "token_id",
    "user",
    "offset",
    "trial",  # a sweep's trial number, in the path of its resume
    "Idempotency-Key",
)


class ErrorDetail(BaseModel):
    """One problem. FastAPI's own 422s add `input`, `ctx` and the like: allowed, not promised."""

    model_config = ConfigDict(extra="allow")

    msg: str
    type: str
    loc: list[str | int] | None = None


class ErrorBody(BaseModel):
    """Every error answer: the shape of FastAPI's 422, so a client parses one shape for all of them."""

    detail: list[ErrorDetail]


ERROR_DESCRIPTIONS: dict[int, str] = {
    401: "No token, a malformed one, or one the service does not know",
    403: "Not allowed: not an admin, over a per-job limit or your code storage, refused by an allow-list, "
    "or a dev-mode service asked from another machine or another site",
    404: "No such job, or one the caller may not see",
    409: "Clashes with the current state (an Idempotency-Key reused with another body), a count at its "
    "limit (webhook subscriptions), or the same work under way did not end in time (retry after "
    "Retry-After seconds)",
    413: "The body is over TORCHYARD_MAX_BODY_BYTES",
    422: "Invalid input; `loc` names the field",
    429: "Over a limit (unfinished jobs, submissions, captures, ...); retry after Retry-After seconds",
    502: "The scheduler refused or could not be reached",
    503: "The job database is unavailable; retry after Retry-After seconds",
    507: "The data directory is full or not writable",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait.", "schema": {"type": "integer"}}}
ERROR_HEADERS: dict[int, dict[str, Any]] = {
    401: {"WWW-Authenticate": {"description": "Bearer", "required": True, "schema": {"type": "string"}}},
    429: RETRY_AFTER,
    503: RETRY_AFTER,
}


def error_responses(*codes: int, json_route: bool = True) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses=` for the errors a route can answer. 401, 403 and 503 always: every route
    checks a token against the ledger, and a dev-mode service refuses other machines.
    `json_route=False` for routes whose success is not JSON: FastAPI would otherwise declare the
    error bodies in the route's own media type."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in sorted({401, 403, 503, *codes}):
        entry: dict[str, Any] = {"description": ERROR_DESCRIPTIONS[code]}
        if json_route:
            entry["model"] = ErrorBody
        else:
            ref = {"$ref": "#/components/schemas/ErrorBody"}
            entry["content"] = {"application/json": {"schema": ref}}
        if code in ERROR_HEADERS:
            entry["headers"] = ERROR_HEADERS[code]
        out[code] = entry
    return out


def error_body(message: str, field: str | None = None) -> dict[str, object]:
    detail: dict[str, object] = {"msg": message, "type": "value_error"}
    if field is not None:
        detail["loc"] = ["body", *body_loc(field)] if field not in NOT_BODY_FIELDS else [field]
    return {"detail": [detail]}


def body_loc(field: str) -> list[str]:
    """Where in the body `field` is. One split: "resources.nodes" is two levels, "env.A.B" is the env
    key "A.B", not three; under a sweep's "job" the job's own fields follow, split the same way."""
    head, _, rest = field.partition(".")
    if head == "job" and rest:
        return [head, *body_loc(rest)]
    if head == "search" and rest.startswith("space."):  # a parameter's name has no dot
        return [head, *rest.split(".", 1)]
    if head == "stages" and rest:  # a pipeline's: stages.<N>, then its job's or sweep's own fields
        index, _, tail = rest.partition(".")
        kind, _, inner = tail.partition(".")
        if kind in ("job", "sweep") and inner:
            return [head, index, kind, *body_loc(inner)]
        return [head, index, *tail.split(".", 1)] if tail else [head, index]
    return field.split(".", 1)


def service_error_response(error: ServiceError) -> JSONResponse:
    """The answer to a ServiceError: the route handlers' and the request gate's (service.api.gate)."""
    status = next((code for kind, code in STATUS_BY_ERROR.items() if isinstance(error, kind)), 400)
    text = f"{error.field}: {error.message}" if error.field else error.message
    headers: dict[str, str] = {}
    if isinstance(error, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    if isinstance(error, RetryLater | Busy):
        headers["Retry-After"] = str(max(1, round(error.retry_after_s)))
    return JSONResponse(error_body(text, error.field), status_code=status, headers=headers)


async def _service_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, ServiceError)
    return service_error_response(error)


async def _invalid_input(request: Request, error: Exception) -> JSONResponse:
    """FastAPI's own 422 without the `input` it echoes: what was refused may be what no response can
    hold (NaN, a lone surrogate, nesting deep enough to exhaust the encoder's recursion), and echoing
    it turned the 422 into a 500. `loc` and `msg` say what and where."""
    assert isinstance(error, RequestValidationError)
    problems = [{key: value for key, value in item.items() if key != "input"} for item in error.errors()]
    return JSONResponse({"detail": storable(jsonable_encoder(problems))}, status_code=422)


UNREADABLE_BODY = "There was an error parsing the body"  # FastAPI's 400 for a body it cannot decode


async def _http_error(request: Request, error: Exception) -> Response:
    """FastAPI answers 422 json_invalid for a body that is not JSON, but a bare 400 in another shape
    for one that is not even UTF-8: both get the 422, so clients handle one answer for bad bodies."""
    assert isinstance(error, HTTPException)
    if error.status_code == 400 and error.detail == UNREADABLE_BODY:
        detail = {"loc": ["body"], "msg": "the body is not valid JSON (UTF-8)", "type": "json_invalid"}
        return JSONResponse({"detail": [detail]}, status_code=422)
    if error.status_code == 413:  # the request gate's, for a body that grew past the limit as it came
        response = service_error_response(TooLarge(str(error.detail)))
        response.headers["Connection"] = "close"
        return response
    return await http_exception_handler(request, error)


async def _illegal_transition(request: Request, error: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(error)), status_code=409)


def database_down_response(error: OperationalError, settings: Settings | None) -> JSONResponse:
    """507 when the database answers but cannot write, else 503: it may be back in a moment."""
    no_room = ledger_storage_problem(error, settings)
    if no_room is not None:  # retrying soon will not help
        log.warning("ledger write refused: %s", error)
        return JSONResponse(error_body(no_room), status_code=507)
    log.warning("database unavailable: %s", error)
    return JSONResponse(
        error_body("the job database is unavailable right now; try again shortly"),
        status_code=503,
        headers={"Retry-After": "2"},
    )


async def _database_down(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, OperationalError)
    runtime = getattr(request.app.state, "runtime", None)
    return database_down_response(error, runtime.settings if runtime is not None else None)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _invalid_input)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(IllegalTransition, _illegal_transition)
    app.add_exception_handler(OperationalError, _database_down)
