"""Real headless Chromium (Debian's, driven by Playwright) against the real service and local backend.

Playwright is imported inside the fixtures: without it (or without /usr/bin/chromium) the root
conftest skips `browser` tests, or fails them under CI=true, before any fixture runs.

Every API call needs a token, the dashboard's too. `page` is a tab already signed in as USER (the
token put in its sessionStorage before the page's scripts run); `blank_page` is a tab with no token.
`submit()` and `job()` call the API with real tokens as well.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from tests.serving import LiveServer, serve
from tests.support import bearer, issue_token

if TYPE_CHECKING:
    from playwright.sync_api import Browser, BrowserContext, Page

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
TOKEN_KEY = "torchyard.token"  # the dashboard's sessionStorage key (service/dashboard/api.js)
USER = "alice"  # whom `page` signs in, and whose jobs submit() makes unless told otherwise
ADMIN = "root"


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
        job_accounts="service",
        database_url=f"sqlite:///{root / 'ledger.db'}",
        data_dir=root / "data",
        local_reconcile_interval_s=0.2,
        dispatch_interval_s=0.2,
    )
    with serve(create_app(settings)) as server:
        yield server
        headers = bearer(token(server, ADMIN, admin=True))  # an admin sees every user's jobs
        listed = httpx.get(f"{server.url}/api/v1/jobs", params={"limit": 500}, headers=headers).json()
        for job in listed["items"]:
            httpx.post(f"{server.url}/api/v1/jobs/{job['id']}/cancel", headers=headers)  # no process left


def token(server: LiveServer, user: str = USER, admin: bool = False) -> str:
    """A real API token for `user` on this server, made once and reused (kept on the app: a later
    server may get the same port, never the same app)."""
    made: dict[tuple[str, bool], str] | None = getattr(server.app.state, "test_tokens", None)
    if made is None:
        made = server.app.state.test_tokens = {}
    if (user, admin) not in made:
        made[user, admin] = issue_token(server.runtime.engine, user, admin=admin)
    return made[user, admin]


def sign_in(context: BrowserContext, raw: str) -> None:
    """Every page of `context` starts with this token in its sessionStorage, as the form leaves it."""
    context.add_init_script(f"sessionStorage.setItem({json.dumps(TOKEN_KEY)}, {json.dumps(raw)})")


@contextmanager
def open_page(browser: Browser, url: str, raw_token: str | None = None, **options: Any) -> Iterator[Page]:
    """A fresh tab on `url` (signed in when given a token) that fails the test on any JavaScript error,
    or on anything the page's Content-Security-Policy refused (the policy must not break the page)."""
    context = browser.new_context(base_url=url, **options)
    if raw_token is not None:
        sign_in(context, raw_token)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(f"{error} {error.stack}"))
    page.on(
        "console",
        lambda message: errors.append(message.text) if "Content Security Policy" in message.text else None,
    )
    try:
        yield page
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


PAGE_OPTIONS: dict[str, Any] = {
    "timezone_id": TIMEZONE,
    "locale": "en-US",
    "viewport": {"width": 1440, "height": 900},
}


@pytest.fixture
def page(browser: Browser, service: LiveServer) -> Iterator[Page]:
    """A tab signed in as USER."""
    with open_page(browser, service.url, token(service), **PAGE_OPTIONS) as page:
        yield page


@pytest.fixture
def blank_page(browser: Browser, service: LiveServer) -> Iterator[Page]:
    """A tab with no token: the dashboard must ask for one."""
    with open_page(browser, service.url, **PAGE_OPTIONS) as page:
        yield page


def submit(
    service: LiveServer, name: str, entrypoint: str, ranks: int = 1, *, user: str = USER, **kwargs: Any
) -> int:
    body = {"name": name, "entrypoint": entrypoint, "kwargs": kwargs, "resources": {"tasks_per_node": ranks}}
    response = httpx.post(f"{service.url}/api/v1/jobs", json=body, headers=bearer(token(service, user)))
    assert response.status_code == 201, response.text
    job_id: int = response.json()["id"]
    return job_id


def job(service: LiveServer, job_id: int) -> dict[str, Any]:
    """The job as the ledger has it (read as an admin: whoever owns it)."""
    response = httpx.get(f"{service.url}/api/v1/jobs/{job_id}", headers=bearer(token(service, ADMIN, True)))
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


def shot(page: Page, folder: Path, name: str) -> Path:
    """A full-page screenshot kept with the test's temp files (pytest keeps the last runs)."""
    path = folder / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"screenshot: {path}")
    return path
