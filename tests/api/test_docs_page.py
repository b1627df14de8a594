"""/docs: Swagger UI from the package, under a Content-Security-Policy of its own, nothing fetched from
elsewhere. The page shares its origin with the dashboard, whose token sits in sessionStorage: a script
from a CDN (unpinned, FastAPI's default) could read it."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from service.api.routes.dashboard import DASHBOARD_DIR
from tests.support import ROOT

VENDORED = ROOT / "service" / "dashboard" / "vendor" / "swagger-ui"
SWAGGER_UI_VERSION = "5.36.0"


def policy(header: str) -> dict[str, list[str]]:
    """A Content-Security-Policy as {directive: [sources]}."""
    return {name: sources for name, *sources in (part.split() for part in header.split(";") if part.strip())}


def test_the_docs_page_loads_only_its_own_files_under_a_strict_policy(api: TestClient) -> None:
    api.headers.pop("Authorization")  # /docs answers without a token (README)
    page = api.get("/docs")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]

    assert re.findall(r"https?://", page.text) == []  # no outside host, not even a favicon
    csp = policy(page.headers["content-security-policy"])
    assert csp["default-src"] == ["'none'"]
    assert csp["script-src"] == ["'self'"] and csp["connect-src"] == ["'self'"]
    assert csp["style-src"] == ["'self'"]
    assert csp["frame-ancestors"] == ["'none'"] and csp["base-uri"] == ["'none'"]
    assert page.headers["x-content-type-options"] == "nosniff"

    assets = [url for url in re.findall(r'(?:src|href)="([^"]+)"', page.text) if url != "data:,"]
    assert {asset.rsplit("/", 1)[-1] for asset in assets} >= {"swagger-ui-bundle.js", "swagger-ui.css"}
    for asset in assets:
        assert asset.startswith("/") and not asset.startswith("//"), asset
        response = api.get(asset)
        assert response.status_code == 200 and response.content, asset
        kind = "css" if asset.endswith(".css") else "javascript"
        assert kind in response.headers["content-type"], asset
    assert api.get("/openapi.json").status_code == 200


def test_redoc_and_the_oauth2_redirect_are_off(api: TestClient) -> None:
    for path in ("/redoc", "/docs/oauth2-redirect"):
        assert api.get(path).status_code == 404, path  # with a token: not there at all


def test_swagger_ui_is_vendored_pinned_with_its_licence() -> None:
    assert VENDORED.parent.parent == DASHBOARD_DIR
    for name in ("LICENSE", "NOTICE", "swagger-ui-bundle.js.LICENSE.txt", "README.md"):
        assert (VENDORED / name).is_file(), name
    assert "Apache License" in (VENDORED / "LICENSE").read_text()
    assert f"# Swagger UI {SWAGGER_UI_VERSION}" in (VENDORED / "README.md").read_text()
    assert f'"{SWAGGER_UI_VERSION}"' in (VENDORED / "swagger-ui-bundle.js").read_text()  # the build's own
