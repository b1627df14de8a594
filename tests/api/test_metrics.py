"""GET /metrics (Prometheus text) and the dashboard's static files."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.states import JobState
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import authorize, wait_for

EP = "worker.tasks.seed:ddp_step"


class CountingBackend(FakeBackend):
    """A backend that counts its scheduler commands, as the SLURM backend does."""

    scheduler_calls = 7


@pytest.fixture
def counted(settings: Settings) -> Iterator[tuple[TestClient, FakeBackend]]:
    backend = CountingBackend("local")
    with TestClient(create_app(settings, backends={"local": backend})) as client:
        yield authorize(client), backend


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in Prometheus text, or None when absent."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        match = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)", line)
        if not match or match[1] != name:
            continue
        found = ",".join(sorted((match[2] or "").split(","))) if match[2] else ""
        if found == wanted:
            return float(match[3])
    return None


def test_metrics_count_jobs_by_state_and_backend_from_the_ledger(
    counted: tuple[TestClient, FakeBackend],
) -> None:
    api, backend = counted
    ids = [api.post("/api/v1/jobs", json={"name": f"m{n}", "entrypoint": EP}).json()["id"] for n in range(3)]
    wait_for(
        lambda: all(api.get(f"/api/v1/jobs/{i}").json()["state"] == "running" for i in ids), what="running"
    )
    backend.set_status(ids[0], JobState.failed, "boom")
    wait_for(lambda: api.get(f"/api/v1/jobs/{ids[0]}").json()["state"] == "failed", what="failed")

    response = api.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=")
    text = response.text
    assert sample(text, "torchyard_jobs", state="running", backend="local") == 2
    assert sample(text, "torchyard_jobs", state="failed", backend="local") == 1
    assert sample(text, "torchyard_jobs", state="timeout", backend="local") == 0  # zeros are kept
    assert sample(text, "torchyard_scheduler_calls_total", backend="local") == 7
    polls = sample(text, "torchyard_reconcile_polls_total", backend="local")
    assert polls is not None and polls >= 1
    assert (sample(text, "torchyard_reconcile_last_duration_seconds", backend="local") or 0) > 0
    assert sample(text, "torchyard_dispatch_last_duration_seconds") is not None
    changes = sample(text, "torchyard_ledger_changes_total")
    assert changes is not None and changes >= 4
    # Goodput by part, summed over the jobs (no label per job): the three ran, the failed one ended.
    assert (sample(text, "torchyard_job_goodput_seconds", part="training") or 0) > 0
    assert sample(text, "torchyard_job_goodput_seconds", part="downtime") == 0
    assert sample(text, "torchyard_job_restarts") == 0


def test_request_latency_is_labelled_by_route_template(api: TestClient) -> None:
    job_id = api.post("/api/v1/jobs", json={"name": "x", "entrypoint": EP}).json()["id"]
    api.get(f"/api/v1/jobs/{job_id}")
    api.get("/api/v1/jobs/424242")
    api.get("/no/such/page")
    text = api.get("/metrics").text
    count = "torchyard_http_request_duration_seconds_count"
    assert sample(text, count, method="GET", route="/api/v1/jobs/{job_id}", status="200") == 1
    assert sample(text, count, method="GET", route="/api/v1/jobs/{job_id}", status="404") == 1
    assert sample(text, count, method="POST", route="/api/v1/jobs", status="201") == 1
    assert sample(text, count, method="GET", route="unmatched", status="404") == 1
    assert f'/api/v1/jobs/{job_id}"' not in text  # raw paths would grow the label set without bound


@pytest.mark.parametrize(
    ("path", "kind"),
    [("/", "text/html"), ("/dashboard/app.js", "javascript"), ("/dashboard/style.css", "text/css")],
)
def test_the_dashboard_is_served_from_the_package(api: TestClient, path: str, kind: str) -> None:
    response = api.get(path)
    assert response.status_code == 200 and response.content
    assert kind in response.headers["content-type"]
    urls = re.findall(r"https?://[^\s'\"]+", response.text)
    assert all(url.startswith("http://www.w3.org/") for url in urls), urls  # nothing from the internet


def test_disk_in_metrics_and_on_the_job_comes_from_stored_sizes(
    counted: tuple[TestClient, FakeBackend], settings: Settings
) -> None:
    import shutil
    from pathlib import Path

    from service.domain import retention
    from tests.support import runtime_of

    api, backend = counted
    job_id = api.post("/api/v1/jobs", json={"name": "disk", "entrypoint": EP}).json()["id"]
    job = wait_for(lambda: (j := api.get(f"/api/v1/jobs/{job_id}").json())["state"] == "running" and j)
    (Path(job["folder"]) / "weights.bin").write_bytes(b"w" * 300_000)
    assert job["folder_bytes"] is None
    assert sample(api.get("/metrics").text, "torchyard_job_folders") == 0  # not measured yet

    backend.finish(job_id, "done")
    wait_for(lambda: api.get(f"/api/v1/jobs/{job_id}").json()["state"] == "succeeded", what="succeeded")
    runtime = runtime_of(api)
    retention.measure_ended(runtime.engine, settings)  # what the housekeeping loop does within seconds
    ended = api.get(f"/api/v1/jobs/{job_id}").json()
    assert ended["folder_bytes"] >= 300_000 and ended["folder_measured_at"] is not None

    (Path(job["folder"]) / "more.bin").write_bytes(b"m" * 300_000)  # not walked at scrape time
    text = api.get("/metrics").text
    assert sample(text, "torchyard_job_folders_bytes") == ended["folder_bytes"]
    assert sample(text, "torchyard_job_folders") == 1
    assert sample(text, "torchyard_job_folder_largest_bytes") == ended["folder_bytes"]
    assert "job_id=" not in text  # any token may read /metrics: it names no job, only totals
    free = sample(text, "torchyard_data_dir_free_bytes")
    assert free is not None and abs(free - shutil.disk_usage(settings.data_dir).free) < 100 * 2**20
    assert sample(text, "torchyard_data_dir_size_bytes") == shutil.disk_usage(settings.data_dir).total
    assert sample(text, "torchyard_retention_freed_bytes_total") == 0


@pytest.mark.parametrize("opentelemetry", [False, True])
def test_requests_ask_opentelemetry_only_when_turned_on(
    settings: Settings, monkeypatch: pytest.MonkeyPatch, opentelemetry: bool
) -> None:
    """FastAPI's native telemetry looks up OpenTelemetry's global providers on each request when on;
    off (the default) no request pays for it."""
    from opentelemetry import trace

    asked: list[int] = []
    provider = trace.get_tracer_provider

    def counted_provider() -> trace.TracerProvider:
        asked.append(1)
        return provider()

    monkeypatch.setattr(trace, "get_tracer_provider", counted_provider)
    turned = settings.model_copy(update={"opentelemetry": opentelemetry})
    app = create_app(turned, backends={"local": FakeBackend("local")})
    with TestClient(app) as client:
        asked.clear()  # start-up's own look
        assert authorize(client).get("/api/v1/jobs").status_code == 200
    assert bool(asked) is opentelemetry


def test_an_admin_finds_the_largest_folders_and_nobody_else_does(api: TestClient, login: Login) -> None:
    from service.ledger.db import session_scope
    from service.ledger.models.jobs import Job
    from tests.support import runtime_of

    ids = [api.post("/api/v1/jobs", json={"name": f"f{n}", "entrypoint": EP}).json()["id"] for n in range(3)]
    wait_for(lambda: all(api.get(f"/api/v1/jobs/{i}").json()["folder"] for i in ids), what="folders")
    with session_scope(runtime_of(api).engine) as session:  # as the housekeeping loop stores them
        for job_id, size in zip(ids, (10, 3000, 200), strict=True):
            session.get_one(Job, job_id).folder_bytes = size

    admin = login("root", admin=True)
    largest = api.get("/api/v1/folders", params={"limit": 2}, headers=admin)
    assert largest.status_code == 200
    assert [(f["id"], f["folder_bytes"]) for f in largest.json()] == [(ids[1], 3000), (ids[2], 200)]
    assert largest.json()[0]["owner"] == api.get(f"/api/v1/jobs/{ids[1]}").json()["owner"]
    assert api.get("/api/v1/folders", headers=login("bob")).status_code == 403
    assert api.get("/api/v1/folders", params={"limit": 0}, headers=admin).status_code == 422
