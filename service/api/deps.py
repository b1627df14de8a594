"""Annotated dependencies the routes declare: the caller, the session, the runtime, the settings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

from fastapi import Depends, Header, Request
from sqlmodel import Session

from service.api.gate import principal_of
from service.config import Settings
from service.domain.auth import Principal
from service.errors import Forbidden
from service.ledger.db import session_scope
from service.runtime import Runtime


async def get_runtime(request: Request) -> Runtime:
    # async: a plain attribute read must not cost a thread-pool hop on every request
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_settings_dep(runtime: RuntimeDep) -> Settings:
    return runtime.settings


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]


def get_session(runtime: RuntimeDep) -> Iterator[Session]:
    """One transaction per request: committed when the route returns, rolled back when it raises."""
    with session_scope(runtime.engine) as session:
        yield session


SessionDep = Annotated[Session, Depends(get_session)]


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


def read_headers(**descriptions: str) -> dict[str, Any]:
    """`openapi_extra` for a route that reads these headers from its Request itself: the schema then
    shows them as it shows declared ones (`if_none_match` is the header If-None-Match).

    Only the routes every dashboard polls do this. FastAPI checks a declared header (or a dependency
    that declares one, as CurrentUser does) on every request, ~20 µs each (measured on a 304 that
    costs ~150 µs in all); those two routes take the caller from the gate's scope (principal_of) and
    their headers from the request, and stay the one answer to what they answer.
    """
    parameters = []
    for name, description in descriptions.items():
        title = "-".join(part.capitalize() for part in name.split("_"))
        schema = {"anyOf": [{"type": "string"}, {"type": "null"}], "description": description, "title": title}
        parameters.append(
            {"name": name.replace("_", "-"), "in": "header", "required": False, "schema": schema,
             "description": description}
        )
    return {"parameters": parameters}
