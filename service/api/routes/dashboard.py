"""The dashboard: static files shipped in the package, served at / (no build step, nothing fetched)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

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

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    return FileResponse(DASHBOARD_DIR / "index.html", headers=PAGE_HEADERS)


def mount(app: FastAPI) -> None:
    """The page at / and its scripts and styles under /dashboard/ (StaticFiles answers 304s itself)."""
    app.include_router(router)
    app.mount(ASSETS_PREFIX, StaticFiles(directory=DASHBOARD_DIR), name="dashboard")
