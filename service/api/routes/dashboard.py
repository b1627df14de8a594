"""The dashboard: static files shipped in the package, served at / (no build step, nothing fetched);
and the API's page at /docs, Swagger UI from the same files."""

from __future__ import annotations

import json
from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from service.states import TERMINAL_STATES, JobState

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "dashboard"
ASSETS_PREFIX = "/dashboard"

# The page holds an API token in sessionStorage, so only our own scripts may run in it (no inline or
# foreign ones), it talks to this origin only, and no other site may frame it and steer its clicks.
# Inline styles stay allowed: the chart and progress bars set widths and colours with them.
CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
PAGE_HEADERS = {
    # no-cache: after an upgrade the browser revalidates and gets the new page, not yesterday's.
    "Cache-Control": "no-cache",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}

# /docs shares the dashboard's origin, and so its sessionStorage and the token in it: FastAPI's own
# page loads an unpinned Swagger UI from a CDN, which could read that token. This page runs the copy
# vendored under vendor/swagger-ui/ and its starter, api_docs.js, and nothing else: no inline script
# or style (Swagger UI sets styles through the DOM, which a policy does not govern), requests to this
# origin only (the schema, "Try it out").
DOCS_CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    ]
)
DOCS_HEADERS = {**PAGE_HEADERS, "Content-Security-Policy": DOCS_CONTENT_SECURITY_POLICY}

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    return FileResponse(DASHBOARD_DIR / "index.html", headers=PAGE_HEADERS)


@router.get("/docs")
def api_docs() -> FileResponse:
    return FileResponse(DASHBOARD_DIR / "api_docs.html", headers=DOCS_HEADERS)


@router.get(f"{ASSETS_PREFIX}/states.js")
def states_module() -> Response:
    """The job states for the page's scripts, written from service.states: the one list, not a copy."""
    return Response(states_js(), media_type="text/javascript", headers=PAGE_HEADERS)


def states_js() -> str:
    states = json.dumps([state.value for state in JobState])
    terminal = json.dumps([state.value for state in JobState if state in TERMINAL_STATES])
    return (
        "// Written by the service from service/states.py.\n"
        f"export const STATES = {states};\n"
        f"export const TERMINAL = new Set({terminal});\n"
    )


def mount_assets(app: FastAPI) -> None:
    """The page's scripts and styles under /dashboard/ (StaticFiles answers 304s itself), after the
    router's routes (the app's): its states.js is found before the static files are looked in."""
    app.mount(ASSETS_PREFIX, StaticFiles(directory=DASHBOARD_DIR), name="dashboard")
