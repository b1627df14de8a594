"""The whole path on one machine: REST -> ledger -> dispatch -> submitit local -> ranks -> ledger.

Real processes, real torch, real gloo. Each job costs a few seconds of torch imports on 2 cores, so
related checks share a job where they can. Failing ranks: test_faults_local.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.ledger.db import make_engine
from service.states import TERMINAL_STATE_NAMES
from tests.cli_service import clean_env
from tests.serving import LiveServer, free_port, serve
from tests.support import ROOT, bearer, issue_token, wait_for

pytestmark = pytest.mark.integration



SCRIPTS = ROOT / "examples/scripts"


@pytest.fixture
def live(tmp_path: Path) -> Iterator[httpx.Client]:
    """A real service on a free port, and an httpx client on it with a token of the user alice."""
    settings = Settings(
        job_accounts="service",
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path}/ledger.db",
        allowed_script_dirs=[str(SCRIPTS)],
    )
    server: LiveServer
    with serve(create_app(settings)) as server, server.client("alice") as client:
        yield client


def submit(client: httpx.Client, **body: Any) -> dict[str, Any]:
    response = client.post("/api/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    job: dict[str, Any] = response.json()
    return job


def job(client: httpx.Client, job_id: int) -> dict[str, Any]:
    value: dict[str, Any] = client.get(f"/api/v1/jobs/{job_id}").raise_for_status().json()
    return value


def finished(client: httpx.Client, job_id: int, timeout: float = 120) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        current = job(client, job_id)
        return current if current["state"] in TERMINAL_STATE_NAMES else None

    return wait_for(probe, timeout, f"job {job_id} to end")


def states(client: httpx.Client, job_id: int) -> list[str]:
    events = client.get(f"/api/v1/jobs/{job_id}/events").raise_for_status().json()
    return [event["to_state"] for event in events]


def test_both_seed_demonstrations_check_out(live: httpx.Client) -> None:
    ddp = submit(
        live, name="ddp", entrypoint="worker.tasks.seed:ddp_parameters", resources={"tasks_per_node": 3}
    )
    shards = submit(
        live,
        name="shards",
        entrypoint="worker.tasks.seed:sampler_shards",
        resources={"tasks_per_node": 4},
    )

    ddp_done = finished(live, ddp["id"])
    assert ddp_done["state"] == "succeeded", ddp_done["reason"]
    result = ddp_done["result"]
    assert result["ok"] is True
    assert result["world_size"] == 3
    assert result["initial_params_match_rank0"] is True
    assert result["params_identical_after_step"] is True
    assert result["matches_averaged_gradient_step"] is True
    assert states(live, ddp["id"]) == ["queued", "submitted", "running", "succeeded"]
    # Rank 0 left the spec it ran with in the folder, for people to read.
    ran_with = json.loads((Path(ddp_done["folder"]) / "spec.json").read_text())
    assert ran_with["job_id"] == ddp["id"] and ran_with["attempt"] == 1
    assert ran_with["entrypoint"] == "worker.tasks.seed:ddp_parameters"

    shards_done = finished(live, shards["id"])
    assert shards_done["state"] == "succeeded", shards_done["reason"]
    assert shards_done["result"]["ok"] is True
    assert shards_done["result"]["shards"] == {str(r): [r, r + 4] for r in range(4)}
    assert shards_done["result"]["dataset_identical_on_all_ranks"] is True


def test_training_reports_falling_loss_into_the_ledger(live: httpx.Client) -> None:
    train = submit(
        live,
        name="train",
        entrypoint="worker.tasks.train:train",
        kwargs={"epochs": 3, "samples": 256, "report_every": 2},
        resources={"tasks_per_node": 2},
    )
    done = finished(live, train["id"])
    assert done["state"] == "succeeded", done["reason"]
    assert done["result"]["final_loss"] < done["result"]["first_loss"]
    assert done["progress"]["step"] == done["progress"]["total"]
    assert done["latest_checkpoint"] and Path(done["latest_checkpoint"]).exists()
    metrics = live.get(f"/api/v1/jobs/{train['id']}/metrics", params={"name": "loss"}).json()
    losses = [m["value"] for m in metrics]
    assert len(losses) >= 3 and losses[-1] < losses[0]
    log = live.get(f"/api/v1/jobs/{train['id']}/logs", params={"rank": 1, "stream": "err"}).text
    assert "[rank 1]" in log


def test_script_mode_runs_an_unmodified_torchrun_script(live: httpx.Client, tmp_path: Path) -> None:
    link = tmp_path / "linked.py"  # outside the allowed folder, but its target lies inside
    link.symlink_to(SCRIPTS / "torchrun_style.py")
    script = submit(
        live,
        name="script",
        script=str(link),
        args=["--out", "sum.json", "--value", "2.0"],
        resources={"tasks_per_node": 2},
    )
    assert script["spec"]["script"] == str((SCRIPTS / "torchrun_style.py").resolve())  # the real path runs
    done = finished(live, script["id"])
    assert done["state"] == "succeeded", done["reason"]
    report = json.loads((Path(done["folder"]) / "sum.json").read_text())  # in the job's own folder
    assert report["world_size"] == 2
    assert report["sum"] == report["expected"] == 6.0


def test_cancel_stops_a_running_job_and_its_processes(live: httpx.Client) -> None:
    sleeper = submit(
        live,
        name="sleeper",
        entrypoint="worker.tasks.faults:sleep",
        kwargs={"seconds": 120},
        resources={"tasks_per_node": 2},
    )
    running = wait_for(lambda: (j := job(live, sleeper["id"]))["state"] == "running" and j, 60, "running")
    assert _group_alive(running["external_id"])
    cancelled = live.post(f"/api/v1/jobs/{sleeper['id']}/cancel").raise_for_status().json()
    assert cancelled["state"] == "cancelled"
    again = live.post(f"/api/v1/jobs/{sleeper['id']}/cancel").raise_for_status().json()
    assert again["state"] == "cancelled" and again["finished_at"] == cancelled["finished_at"]
    wait_for(lambda: not _group_alive(running["external_id"]), 15, "the job's processes to stop")


def test_service_killed_mid_job_settles_it_after_restart(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path}/ledger.db"
    env = clean_env(TORCHYARD_DATA_DIR=str(tmp_path / "data"), TORCHYARD_DATABASE_URL=ledger)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = start_service(env, port)
    engine = make_engine(ledger)
    try:
        headers = bearer(issue_token(engine, "alice"))  # stored in the ledger: the restart keeps it
    finally:
        engine.dispose()
    with httpx.Client(base_url=url, headers=headers, timeout=30) as client:
        try:
            slow = submit(
                client,
                name="slow",
                entrypoint="worker.tasks.faults:sleep",
                kwargs={"seconds": 8},
                resources={"tasks_per_node": 2},
            )
            doomed = submit(
                client,
                name="doomed",
                entrypoint="worker.tasks.faults:sleep",
                kwargs={"seconds": 120},
                resources={"tasks_per_node": 2},
            )
            wait_for(
                lambda: all(job(client, j["id"])["state"] == "running" for j in (slow, doomed)), 60, "running"
            )
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        doomed_pid = job_external_id(tmp_path, doomed["id"])
        os.killpg(int(doomed_pid), signal.SIGKILL)  # this one dies while nobody watches: no result
        time.sleep(9)  # and the slow one finishes while the service is down

        second = start_service(env, port)
        try:
            slow_done = finished(client, slow["id"], timeout=30)
            doomed_done = finished(client, doomed["id"], timeout=30)
            assert slow_done["state"] == "succeeded", slow_done["reason"]
            assert slow_done["result"]["slept_s"] >= 8
            assert doomed_done["state"] == "failed"
            assert "without a result" in doomed_done["reason"]
            listed = client.get("/api/v1/jobs").json()["items"]
            assert sorted(j["id"] for j in listed) == sorted([slow["id"], doomed["id"]])  # no duplicate
            assert states(client, slow["id"]).count("submitted") == 1
        finally:
            second.terminate()
            second.wait(timeout=30)


def job_external_id(tmp_path: Path, job_id: int) -> str:
    import sqlite3

    with sqlite3.connect(tmp_path / "ledger.db") as connection:
        row = connection.execute("SELECT external_id FROM job WHERE id = ?", (job_id,)).fetchone()
    return str(row[0])


def start_service(env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "service.app:create_app",
            "--factory",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        env=env,
    )

    def up() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 30, "the service to start")
    return process


def _group_alive(external_id: str) -> bool:
    """True while any process of the job's process group (controller + ranks) is alive."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[2] == external_id and fields[0] not in ("Z", "X"):
            return True
    return False
