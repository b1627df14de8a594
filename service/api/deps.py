"""Annotated dependencies the routes declare: the session, the runtime, the settings."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlmodel import Session

from service.config import Settings
from service.db import session_scope
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
