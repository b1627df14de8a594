"""Annotated dependencies the routes declare: the caller, the session, the runtime, the settings."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Coroutine, Iterator
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Header, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from sqlmodel import Session

from service.api.gate import principal_of
from service.config import Settings
from service.domain.auth import Principal
from service.errors import Forbidden
from service.ledger.db import session_scope
from service.runtime import Runtime

P = TypeVar("P", bound=BaseModel)


def runtime_of(request: Request) -> Runtime:
    """The polled routes call this rather than declare RuntimeDep (read_params says why)."""
    runtime: Runtime = request.app.state.runtime
    return runtime


async def get_runtime(request: Request) -> Runtime:
    # async: a plain attribute read must not cost a thread-pool hop on every request
    return runtime_of(request)


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_settings_dep(runtime: RuntimeDep) -> Settings:
    return runtime.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """One transaction per request: committed when the route returns, rolled back when it raises."""
    with session_scope(runtime.engine) as session:
        yield session


# scope="function": committed before the answer is sent. FastAPI ends a yield dependency of the
# default scope only after sending the response, so a client could act on an answer whose write was
# not yet committed (an upload's snapshot missing from the job it then submitted), or be told of a
# write whose commit then failed; and a streamed download would hold its session to the last byte.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


AUTHORIZATION = "'Bearer <token>' (`torchyard token create`)."


async def get_current_user(
    request: Request,
    authorization: Annotated[str | None, Header(description=AUTHORIZATION)] = None,
) -> Principal:
    """Who is asking: found by the request gate (service.api.gate) before the body was read. The
    header is declared here so that the API schema shows it; the gate is what checks it."""
    return principal_of(request.scope)


CurrentUser = Annotated[Principal, Depends(get_current_user)]


async def get_admin(user: CurrentUser) -> Principal:
    if not user.admin:
        raise Forbidden("only an admin may do this")
    return user


AdminUser = Annotated[Principal, Depends(get_admin)]


def read_params(request: Request, params: type[P]) -> P:
    """The route's path and query parameters, validated by `params` (a model with a field each) as
    FastAPI validates them declared one by one: a 422 whose `loc` is ["query" or "path", name, ...].

    Only the routes every dashboard polls do this, with `polled_route` for their schema. FastAPI
    inspects each declared parameter's type on every request, a large share of a job list's 304;
    one model's validation costs less than one parameter's inspection (bench.poll's 304 paths).
    The same goes for declared headers (or a dependency that declares one, as CurrentUser does) and
    dependencies (RuntimeDep): those routes take the caller from the gate's scope
    (principal_of), the runtime from runtime_of and their headers from the request.
    """
    values: dict[str, Any] = dict(request.path_params)
    query = request.query_params
    for name in params.model_fields:
        if name in values or name not in query:
            continue
        # A repeated scalar takes its last value, a list all of them: what FastAPI reads.
        values[name] = query.getlist(name) if name in _list_fields(params) else query[name]
    try:
        return params.model_validate(values)
    except ValidationError as error:
        problems = error.errors(include_url=False)
        raise RequestValidationError(
            [{**problem, "loc": (_where(problem["loc"], request), *problem["loc"])} for problem in problems]
        ) from None


def _where(loc: tuple[int | str, ...], request: Request) -> str:
    return "path" if loc and loc[0] in request.path_params else "query"


@functools.cache
def _list_fields(params: type[BaseModel]) -> frozenset[str]:
    def is_list(annotation: Any) -> bool:
        origin = typing.get_origin(annotation)
        if origin in (typing.Union, types.UnionType):
            return any(is_list(arg) for arg in typing.get_args(annotation))
        return origin in (list, tuple, set, frozenset)

    return frozenset(name for name, field in params.model_fields.items() if is_list(field.annotation))


class PolledRoute(APIRoute):
    """A route whose endpoint takes nothing but the Request (an async one, answering a Response) is
    called directly; any other route is FastAPI's as usual.

    FastAPI's request handler still ran for such an endpoint: its body and dependency machinery and
    its telemetry operations, with nothing to solve: a sizeable share of the event loop's time on a
    quiet job list (bench.api's list: the 50 newest of 100,000). What the polls
    read, read_params and principal_of read from the request; their schema is polled_route's.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        wanted = self.dependant
        only_the_request = wanted.request_param_name is not None and not (
            wanted.path_params or wanted.query_params or wanted.header_params or wanted.cookie_params
            or wanted.body_params or wanted.dependencies
        )  # fmt: skip
        if only_the_request and inspect.iscoroutinefunction(self.endpoint):
            endpoint: Callable[[Request], Coroutine[Any, Any, Response]] = self.endpoint
            return endpoint
        return super().get_route_handler()


def polled_route(path: str, params: type[BaseModel], **headers: str) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `params` (read_params) and these headers from its
    Request itself: the schema then shows them as it shows declared ones (`if_none_match` is the
    header If-None-Match; a field named in `path`, such as {job_id}, is a path parameter)."""
    schema = params.model_json_schema(ref_template="#/components/schemas/{model}")
    parameters = []
    for name, field in params.model_fields.items():
        in_path = f"{{{name}}}" in path
        parameter = {
            "name": name,
            "in": "path" if in_path else "query",
            "required": in_path or field.is_required(),
            "schema": schema["properties"][name],
        }
        if field.description:
            parameter["description"] = field.description
        parameters.append(parameter)
    for name, description in headers.items():
        title = "-".join(part.capitalize() for part in name.split("_"))
        header_schema = {
            "anyOf": [{"type": "string"}, {"type": "null"}],
            "description": description,
            "title": title,
        }
        parameters.append(
            {
                "name": name.replace("_", "-"),
                "in": "header",
                "required": False,
                "schema": header_schema,
                "description": description,
            }
        )
    return {"parameters": parameters}
