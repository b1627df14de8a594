"""Run the service inside this process, in a thread: what `torchyard demo` uses, and the tests' live server.

The listening socket is bound here, before uvicorn starts, so a taken port is a clear error at once
(or, when the caller allows it, a free port instead) rather than a log line from another thread.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any

import uvicorn

from service.app import create_app
from service.config import Settings
from service.serving import uvicorn_config

START_TIMEOUT_S = 60.0
App = Callable[[Any, Any, Any], Awaitable[None]]  # an ASGI app (FastAPI is imported only where it is built)


class PortTaken(OSError):
    pass


def bind(host: str, port: int, fallback_to_free: bool) -> socket.socket:
    """A listening socket on (host, port); on a taken port, one on a free port if allowed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        if not fallback_to_free:
            sock.close()
            raise PortTaken(f"cannot listen on {host}:{port}: {error.strerror or error}") from error
        sock.bind((host, 0))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class EmbeddedService:
    """`with EmbeddedService(settings) as service:` serves at service.url until the block ends.

    `app`: serve this app instead of one made from `settings` (tests build theirs with fake backends);
    `settings` then says only where to listen (port 0: any free port).
    """

    def __init__(
        self, settings: Settings, fallback_to_free_port: bool = False, app: App | None = None
    ) -> None:
        self.settings = settings
        self._socket = bind(settings.host, settings.port, fallback_to_free_port)
        self.port: int = self._socket.getsockname()[1]
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        self.url = f"http://{host}:{self.port}"
        config = uvicorn_config(
            app if app is not None else create_app(settings.model_copy(update={"port": self.port})),
            settings,
            log_level="warning",  # the demo's own output is the story; uvicorn's access log is noise
            access_log=False,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, name="torchyard-service", daemon=True
        )

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:  # set once the lifespan (migrations, loops) has finished
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the service did not start; see the log lines above")
            time.sleep(0.05)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()

    def wait(self) -> None:
        """Block until the service stops (Ctrl-C raises KeyboardInterrupt here, in the main thread)."""
        while self._thread.is_alive():
            self._thread.join(timeout=0.5)

    def __enter__(self) -> EmbeddedService:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
