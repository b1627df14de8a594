"""/docs in a real browser: Swagger UI renders the API from the package alone, under the page's
Content-Security-Policy (open_page fails the test on anything the policy refused), and asks no other
host for anything."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from service.app import create_app
from service.config import Settings
from tests.browser.conftest import PAGE_OPTIONS, open_page
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Route

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Shadows the conftest's: the page only reads the schema, so no job has to run."""
    root = tmp_path_factory.mktemp("docs")
    settings = Settings(
        database_url=f"sqlite:///{root / 'ledger.db'}", data_dir=root / "data", job_accounts="service"
    )
    with serve(create_app(settings, backends={"local": FakeBackend("local")})) as server:
        yield server


def test_the_docs_page_renders_offline_from_the_service_alone(browser: Browser, service: LiveServer) -> None:
    elsewhere: list[str] = []

    def refuse(route: Route) -> None:
        elsewhere.append(route.request.url)
        route.abort()

    with open_page(browser, service.url, **PAGE_OPTIONS) as page:  # no token: /docs is public
        page.route(lambda url: not url.startswith(service.url), refuse)
        page.goto("/docs")
        page.wait_for_selector(".swagger-ui .info .title")
        assert "torchyard" in page.inner_text(".swagger-ui .info .title")
        page.wait_for_selector(".opblock-summary-path[data-path='/api/v1/jobs/{job_id}/checkpoints']")
        assert page.locator(".opblock").count() > 20
        page.click(".opblock-summary-path[data-path='/healthz']")  # an operation opens: the UI runs
        page.wait_for_selector(".opblock.is-open")
    assert elsewhere == []
