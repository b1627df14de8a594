"""The real service over real HTTP: uvicorn in a thread on 127.0.0.1 and a free port.

TestClient calls the app in-process; polling clients, a browser and wrk need a socket.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI

from service.config import Settings
from service.embedded import EmbeddedService
from service.runtime import Runtime
from tests.support import login_headers


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class LiveServer:
    app: FastAPI
    url: str

    @property
    def runtime(self) -> Runtime:
        runtime: Runtime = self.app.state.runtime
        return runtime

    def login(self, user: str = "alice", admin: bool = False) -> dict[str, str]:
        """Headers with a fresh real token for `user` on this service."""
        return login_headers(self.app, user, admin=admin)

    def client(self, user: str = "alice", admin: bool = False, timeout: float = 30) -> httpx.Client:
        """An httpx client on this service that sends a token of `user` with every request."""
        return httpx.Client(base_url=self.url, headers=self.login(user, admin), timeout=timeout)


@contextmanager
def serve(app: FastAPI) -> Iterator[LiveServer]:
    """Run `app` (lifespan included) on 127.0.0.1 and a free port until the block ends."""
    made_with: Settings = getattr(app.state, "settings", None) or Settings()  # its connection limits
    anywhere = made_with.model_copy(update={"host": "127.0.0.1", "port": 0})  # 0: a free port (no validation)
    with EmbeddedService(anywhere, app=app) as service:
        yield LiveServer(app=app, url=service.url)
