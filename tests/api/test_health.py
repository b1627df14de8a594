"""/healthz and the API's own documentation."""

from __future__ import annotations

from fastapi.testclient import TestClient


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
