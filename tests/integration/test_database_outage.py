"""The ledger's PostgreSQL goes away mid-service and comes back: clear 503s meanwhile, no job lost.

A private server (deploy/postgres/start.sh in a temp folder, not the session's shared one) is stopped
and started again on the same port and data folder while a real service (uvicorn on a socket) runs
on it. The backend is tests.fakes.FakeBackend: the jobs' fates are scripted, some of them settled
while the database is down, so that the reconciler must write them once it is back.
"""

from __future__ import annotations

import functools
import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.states import JobState
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve
from tests.support import ROOT, missing_dependency, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.integration]

PG_BIN = Path(os.environ.get("TORCHYARD_PG_BIN", "/usr/lib/postgresql/15/bin"))
JOBS = "/api/v1/jobs"


class StoppablePostgres:
    """A server of this test's own: start.sh once, then stop and start again at will."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        self.url = ""

    def _env(self) -> dict[str, str]:
        return {**os.environ, "TORCHYARD_PG_DIR": str(self.dir), "TORCHYARD_PG_DB": "torchyard"}

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), env=self._env(), capture_output=True, text=True, timeout=120)

    def start(self) -> None:
        done = self._run("bash", str(ROOT / "deploy/postgres/start.sh"))
        if done.returncode != 0:
            missing_dependency(f"PostgreSQL could not start: {done.stderr.strip()[-1000:]}")
        self.url = done.stdout.strip().splitlines()[-1]

    def stop(self) -> None:
        """The outage: a fast shutdown (sessions are ended), data folder kept."""
        done = self._run("bash", str(ROOT / "deploy/postgres/stop.sh"), "--keep")
        assert done.returncode == 0, done.stderr

    def restart(self) -> None:
        """The same server again: pg_ctl restart on a stopped server reuses its last command line
        (postmaster.opts: the same port, socket folder and settings start.sh gave it)."""
        data = self.dir / "data"
        command = [str(PG_BIN / "pg_ctl"), "-D", str(data), "-l", str(self.dir / "server.log"), "-w"]
        if os.getuid() == 0:  # start.sh runs the server as the owner of its data folder
            command = ["runuser", "-u", data.owner(), "--", *command]
        done = self._run(*command, "restart")
        assert done.returncode == 0, done.stdout + done.stderr

    def remove(self) -> None:
        self._run("bash", str(ROOT / "deploy/postgres/stop.sh"))


@pytest.fixture
def postgres() -> Iterator[StoppablePostgres]:
    # Not under tmp_path: pytest's folders are the test user's alone, and the server runs as postgres.
    server = StoppablePostgres(Path(tempfile.mkdtemp(prefix="torchyard-pg-outage-")))
    server.start()
    try:
        yield server
    finally:
        server.remove()


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend("local")


@pytest.fixture
def live(postgres: StoppablePostgres, fake: FakeBackend, tmp_path: Path) -> Iterator[LiveServer]:
    settings = Settings(
        job_accounts="service",
        database_url=postgres.url,
        data_dir=tmp_path / "data",
        reconcile_interval_s=0.1,
        local_reconcile_interval_s=0.1,
        dispatch_interval_s=0.1,
        token_cache_s=0,  # every request checks its token in the ledger: the outage is felt at once
    )
    with serve(create_app(settings, backends={"local": fake})) as server:
        yield server


def submit(client: httpx.Client, name: str, **headers: str) -> httpx.Response:
    body = {"name": name, "entrypoint": "worker.tasks.seed:ddp_step"}
    return client.post(JOBS, json=body, headers=headers)


def state(client: httpx.Client, job_id: int) -> str:
    job: dict[str, Any] = client.get(f"{JOBS}/{job_id}").raise_for_status().json()
    return str(job["state"])


def wait_state(client: httpx.Client, job_id: int, wanted: str, timeout: float = 30) -> None:
    wait_for(lambda: state(client, job_id) == wanted, timeout, f"job {job_id} to be {wanted}")


def assert_unavailable(response: httpx.Response) -> None:
    """503 with Retry-After and a JSON detail that says what is wrong, in the API's error shape."""
    assert response.status_code == 503, response.text
    assert response.headers.get("Retry-After", "").isdigit()
    (detail,) = response.json()["detail"]
    assert "database is unavailable" in detail["msg"], detail


def logged(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return text in caplog.text


def loop_threads() -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith("torchyard-")}


def test_the_api_answers_503_while_postgres_is_down_and_recovers_with_every_job(
    postgres: StoppablePostgres, live: LiveServer, fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    threads = loop_threads()
    assert {"torchyard-dispatch", "torchyard-intake"} <= threads
    client: httpx.Client
    with live.client("alice") as client:
        ids = {}
        for name in ("finishes-meanwhile", "fails-meanwhile", "runs-through"):
            response = submit(client, name)
            assert response.status_code == 201, response.text
            ids[name] = response.json()["id"]
        for job_id in ids.values():
            wait_state(client, job_id, "running")
        fake.submit_error = "scheduler busy"  # the next job stays queued: dispatch must resume it later
        response = submit(client, "queued-through")
        assert response.status_code == 201, response.text
        ids["queued-through"] = response.json()["id"]
        wait_for(lambda: fake.submit_calls and fake.submit_calls[-1] == [ids["queued-through"]], 10,
                 "a refused dispatch of the queued job")
        assert state(client, ids["queued-through"]) == "queued"
        # A filtered page is read in a worker thread, on a connection of the reader's own that is
        # kept open: after the restart it must be replaced, not fail every read.
        assert client.get(JOBS, params={"state": "running"}).status_code == 200

        postgres.stop()
        # While it is down, the jobs carry on: two end, and the scheduler takes submissions again.
        fake.finish(ids["finishes-meanwhile"], {"ok": True, "during": "outage"})
        fake.set_status(ids["fails-meanwhile"], JobState.failed, "rank 1 exited with status 3", 3)
        fake.submit_error = None

        health = httpx.get(f"{live.url}/healthz", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "degraded", health.text
        assert_unavailable(client.get(JOBS))
        assert_unavailable(client.get(JOBS, params={"state": "running"}))
        assert_unavailable(client.get(f"{JOBS}/{ids['runs-through']}"))
        assert_unavailable(submit(client, "during-outage", **{"Idempotency-Key": "retry-me"}))
        assert_unavailable(client.post(f"{JOBS}/{ids['runs-through']}/cancel"))
        # The dashboard's files need no database; the loops keep running (and failing) meanwhile.
        assert httpx.get(f"{live.url}/", timeout=10).status_code == 200
        for failure in ("reconcile of local failed", "dispatch tick failed"):
            wait_for(functools.partial(logged, caplog, failure), 10, f"a loop to log '{failure}'")
        assert loop_threads() == threads  # ... and lived on

        postgres.restart()
        wait_for(lambda: httpx.get(f"{live.url}/healthz", timeout=10).status_code == 200, 30,
                 "/healthz to say ok again")
        wait_state(client, ids["finishes-meanwhile"], "succeeded")
        wait_state(client, ids["fails-meanwhile"], "failed")
        wait_state(client, ids["queued-through"], "running")  # the dispatch loop came back by itself
        assert state(client, ids["runs-through"]) == "running"
        running = client.get(JOBS, params={"state": "running"}).raise_for_status().json()["items"]
        assert ids["runs-through"] in {job["id"] for job in running}
        fake.finish(ids["runs-through"], {"ok": True})
        fake.finish(ids["queued-through"], {"ok": True})
        wait_state(client, ids["runs-through"], "succeeded")
        wait_state(client, ids["queued-through"], "succeeded")

        done = client.get(f"{JOBS}/{ids['finishes-meanwhile']}").json()
        assert done["result"] == {"ok": True, "during": "outage"}
        failed = client.get(f"{JOBS}/{ids['fails-meanwhile']}").json()
        assert "rank 1 exited with status 3" in failed["reason"] and failed["exit_code"] == 3

        # The POST that got a 503 stored nothing: its retry with the same key makes the job, once.
        retried = submit(client, "during-outage", **{"Idempotency-Key": "retry-me"})
        assert retried.status_code == 201, retried.text
        again = submit(client, "during-outage", **{"Idempotency-Key": "retry-me"})
        assert again.status_code == 200 and again.json()["id"] == retried.json()["id"]
        wait_state(client, retried.json()["id"], "running")

        listed = client.get(JOBS, params={"limit": 100}).json()["items"]
        assert sorted((job["name"], job["state"]) for job in listed) == sorted([
            ("finishes-meanwhile", "succeeded"),
            ("fails-meanwhile", "failed"),
            ("runs-through", "succeeded"),
            ("queued-through", "succeeded"),
            ("during-outage", "running"),
        ])
        history = client.get(f"{JOBS}/{ids['queued-through']}/events").json()
        assert [event["to_state"] for event in history] == ["queued", "submitted", "running", "succeeded"]
        assert loop_threads() == threads
