"""/healthz and the API's own documentation."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from tests.fakes import FakeBackend
from tests.support import runtime_of


def test_healthz_reports_the_database_and_backends(api: TestClient) -> None:
    response = api.get("/healthz")

    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok" and body["database"] == "ok"
    assert body["backends"] == ["local", "slurm"]


def test_openapi_describes_every_endpoint(api: TestClient) -> None:
    response = api.get("/openapi.json")

    assert response.status_code == 200
    paths = response.json()["paths"]
    assert {"get", "post"} <= set(paths["/api/v1/jobs"])
    for path in ("", "/events", "/metrics", "/logs"):
        assert "get" in paths["/api/v1/jobs/{job_id}" + path], path
    assert "post" in paths["/api/v1/jobs/{job_id}/cancel"]
    assert "get" in paths["/healthz"]
    schemas = response.json()["components"]["schemas"]
    assert {"name", "entrypoint", "script", "resources"} <= set(schemas["JobCreate"]["properties"])


def test_docs_page_is_served(api: TestClient) -> None:
    response = api.get("/docs")

    assert response.status_code == 200
    assert "text/html" in response.headers["content-type"]
    assert "swagger" in response.text.lower() and "/openapi.json" in response.text


def test_healthz_is_degraded_when_the_ledger_file_is_overwritten(settings: Settings, tmp_path: Path) -> None:
    """`SELECT 1` never reads the file: a ledger a job truncated or overwrote passed it (issue 14)."""
    if not settings.resolved_database_url().startswith("sqlite"):
        pytest.skip("a SQLite file is what a job could have overwritten")
    with TestClient(create_app(settings, backends={"local": FakeBackend("local")})) as client:
        assert client.get("/healthz").status_code == 200
        with runtime_of(client).engine.connect() as connection:  # the pages into the file, out of the WAL
            connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
        ledger = Path(settings.resolved_database_url().removeprefix("sqlite:///"))
        ledger.write_text('{"sum": 6.0}\n' * 1000)  # what the old example script wrote with --out
        response = client.get("/healthz")
    assert response.status_code == 503, response.text
    assert response.json()["status"] == "degraded"


def test_only_the_public_paths_answer_without_a_token(settings: Settings) -> None:
    """The README's promise: /healthz, the dashboard's page and the API's description are public
    (the same for everyone, no job's data); everything under /api needs a token (issue 15)."""
    with TestClient(create_app(settings, backends={"local": FakeBackend("local")})) as client:
        for path in ("/healthz", "/", "/docs", "/openapi.json"):
            assert client.get(path).status_code == 200, path
        for path in ("/api/v1/jobs", "/api/v1/jobs/1", "/api/v1/whoami", "/api/v1/audit", "/metrics"):
            assert client.get(path).status_code == 401, path
