"""The dashboard: static files shipped in the package, served at / (no build step, nothing fetched)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "dashboard"
ASSETS_PREFIX = "/dashboard"

router = APIRouter(include_in_schema=False)


@router.get("/")
def index() -> FileResponse:
    # no-cache: after an upgrade the browser revalidates and gets the new page, not yesterday's.
    return FileResponse(DASHBOARD_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def mount(app: FastAPI) -> None:
    """The page at / and its scripts and styles under /dashboard/ (StaticFiles answers 304s itself)."""
    app.include_router(router)
    app.mount(ASSETS_PREFIX, StaticFiles(directory=DASHBOARD_DIR), name="dashboard")
