"""Real headless Chromium (Debian's, driven by Playwright) against the real service and local backend.

Playwright is imported inside the fixtures: without it (or without /usr/bin/chromium) the root
conftest skips `browser` tests, or fails them under CI=true, before any fixture runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from tests.serving import LiveServer, serve

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = "/usr/bin/chromium"
# Quiet and working as root with no network (../shared/facts/browser.md).
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEZONE = "Asia/Tokyo"  # not the machine's zone: times on the page must follow the browser's


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The service as `torchyard serve` runs it: SQLite in a temp folder, the real local backend."""
    root = tmp_path_factory.mktemp("service")
    settings = Settings(
        database_url=f"sqlite:///{root / 'ledger.db'}",
        data_dir=root / "data",
        local_reconcile_interval_s=0.2,
        dispatch_interval_s=0.2,
    )
    with serve(create_app(settings)) as server:
        yield server
        for job in httpx.get(f"{server.url}/api/v1/jobs", params={"limit": 500}).json()["items"]:
            httpx.post(f"{server.url}/api/v1/jobs/{job['id']}/cancel")  # leave no process behind


@pytest.fixture
def page(browser: Browser, service: LiveServer) -> Iterator[Page]:
    context = browser.new_context(
        base_url=service.url, timezone_id=TIMEZONE, locale="en-US", viewport={"width": 1440, "height": 900}
    )
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def submit(service: LiveServer, name: str, entrypoint: str, ranks: int = 1, **kwargs: Any) -> int:
    body = {"name": name, "entrypoint": entrypoint, "kwargs": kwargs, "resources": {"tasks_per_node": ranks}}
    response = httpx.post(f"{service.url}/api/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    job_id: int = response.json()["id"]
    return job_id


def job(service: LiveServer, job_id: int) -> dict[str, Any]:
    data: dict[str, Any] = httpx.get(f"{service.url}/api/v1/jobs/{job_id}").json()
    return data


def shot(page: Page, folder: Path, name: str) -> Path:
    """A full-page screenshot kept with the test's temp files (pytest keeps the last runs)."""
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
