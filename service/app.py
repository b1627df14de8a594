"""create_app(settings): the FastAPI app; its lifespan starts and stops the service's loops."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import APIRouter, FastAPI
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from service.api.errors import install_error_handlers
from service.api.gate import RequestGate
from service.api.loopback import is_loopback
from service.api.metrics import LatencyMiddleware, ServiceMetrics
from service.api.proxy_user import PeerMiddleware
from service.api.routes import (
    access,
    checkpoints,
    code,
    dashboard,
    health,
    jobs,
    logins,
    notifications,
    pipelines,
    stacks,
    sweeps,
)
from service.api.routes import metrics as metrics_routes
from service.backends.base import Backend
from service.config import Settings, get_settings
from service.runtime import Runtime

if TYPE_CHECKING:  # FastAPI before its native OpenTelemetry takes the argument as an extra
    from fastapi.telemetry import TelemetryConfig

log = logging.getLogger(__name__)


# Routes are matched in order, each tried on every request that gets that far: the routes every
# dashboard polls come first. create_app puts the routers' routes on the app's own router rather than
# through include_router: since FastAPI 0.137 an included router stays a node that every request
# resolves twice (to match, then to handle), a sizeable share of a poll's cost (bench.poll's 304
# paths). Each route already carries its router's prefix, tags and class, and none is included with
# options of its own, so these are the same routes and the same API schema.
ROUTERS: tuple[APIRouter, ...] = (
    jobs.router,
    checkpoints.router,
    stacks.router,
    health.router,
    sweeps.router,
    pipelines.router,
    access.router,
    logins.router,
    code.router,
    notifications.router,
    metrics_routes.router,
    dashboard.router,  # before the page's static files (mount_assets): its states.js is found first
)


def create_app(settings: Settings | None = None, backends: dict[str, Backend] | None = None) -> FastAPI:
    settings = settings or get_settings()
    if settings.dev_mode and not is_loopback(settings.host):
        raise ValueError(
            f"dev mode (no tokens) listens on this machine only, not on {settings.host!r}: "
            "use TORCHYARD_HOST=127.0.0.1, or create tokens and turn dev mode off"
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = Runtime.build(settings, backends)
        app.state.runtime = runtime
        runtime.start()
        log.info("torchyard serving; data in %s", settings.data_dir.resolve())
        if settings.dev_mode:
            log.warning("DEV MODE: no tokens are checked; every caller on this machine is admin")
        try:
            yield
        finally:
            runtime.stop()

    app = FastAPI(
        title="torchyard",
        version="0.1.0",
        summary="Launch PyTorch distributed training on this machine or a SLURM cluster.",
        lifespan=lifespan,
        telemetry=_telemetry(settings),
        docs_url=None,  # the dashboard's router serves /docs from the package, under a policy of its own
        redoc_url=None,  # ReDoc would load from a CDN too; /docs is the one page
    )
    app.state.settings = settings  # what it was made with, for whoever serves it (tests.serving)
    install_error_handlers(app)
    app.state.metrics = ServiceMetrics(lambda: getattr(app.state, "runtime", None))
    app.add_middleware(RequestGate, settings=settings)
    if settings.trusted_proxies:  # outside the gate: the client they name is the one it checks
        app.add_middleware(ProxyHeadersMiddleware, trusted_hosts=settings.trusted_proxies)
        app.add_middleware(PeerMiddleware)  # outside it: who connected, for the proxy's user header
    app.add_middleware(LatencyMiddleware, metrics=app.state.metrics)  # last added: outermost
    # Matched in order, ahead of FastAPI's own route (/openapi.json): see ROUTERS.
    app.router.routes[:0] = [route for router in ROUTERS for route in router.routes]
    dashboard.mount_assets(app)
    return app


def _telemetry(settings: Settings) -> TelemetryConfig:
    """FastAPI's own OpenTelemetry, off unless asked for. When on, FastAPI asks OpenTelemetry's global
    providers on every request whether one is configured, a measurable share of a polled list's
    time (bench.poll), for spans that only an operator's OTel SDK would collect. The service's own
    figures are at /metrics either way."""
    enabled = settings.opentelemetry
    return {"tracing": enabled, "metrics": enabled, "logs": enabled}
