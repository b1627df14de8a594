"""Retries on the real two-node SLURM cluster: a job that raises after its first checkpoint, a rank
SIGKILLed mid-training, and a node that dies under a 2-node job. Each attempt is a new SLURM job of the
same torchyard job, resumed from the newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from service.app import create_app
from tests.integration.slurm.conftest import (
    Api,
    ServiceProcess,
    ledger_token,
    sacct_jobs,
    service_env,
    slurm_now,
)
from tests.integration.slurm.test_faults_slurm import slow_sbatch
from tests.integration.slurm.test_service_slurm import scancel_ours, settings_for
from tests.serving import LiveServer, serve
from tests.support import ROOT, issue_token, rank_pid, wait_for

pytestmark = pytest.mark.slurm

TRAIN = "worker.tasks.train:train"
UPSTREAM_ECHO = "worker.tasks.upstream:echo"
KWARGS = {"epochs": 4, "samples": 256, "batch_size": 32, "seed": 5}
FAST_RETRIES = {"max": 2, "backoff_s": 1, "backoff_factor": 1}


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveServer]:
    with serve(create_app(settings_for(tmp_path))) as server:
        yield server
        scancel_ours(server)


@pytest.fixture
def api(live: LiveServer) -> Api:
    return Api(live.url, issue_token(live.runtime.engine, "alice"))


def attempts(api: Api, job_id: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = api.get(f"/api/v1/jobs/{job_id}/attempts").raise_for_status().json()
    return found


def first_checkpoint(api: Api, job_id: int) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        job = api.job(job_id)
        return job if job["latest_checkpoint"] and job["state"] == "running" else None

    return wait_for(probe, 180, f"job {job_id}'s first checkpoint")


def test_a_run_that_raises_after_a_checkpoint_resumes_on_attempt_2_bit_for_bit(api: Api) -> None:
    resources = {"nodes": 2, "tasks_per_node": 1, "timeout_min": 5}
    retries = {"max": 2, "backoff_s": 3, "backoff_factor": 1, "on": ["failure"]}
    broken = api.submit(name="breaks", entrypoint=TRAIN, retries=retries, resources=resources,
                        kwargs={**KWARGS, "fail_on_attempts": [1]})["id"]  # fmt: skip
    whole = api.submit(name="whole", entrypoint=TRAIN, resources=resources, kwargs=KWARGS)["id"]

    done, reference = api.finished(broken, timeout=300), api.finished(whole, timeout=300)

    assert done["state"] == "succeeded", done["reason"]
    assert reference["state"] == "succeeded", reference["reason"]
    assert (done["attempt"], done["result"]["resumed_from_epoch"]) == (2, 0)
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]  # bit for bit
    events = api.get(f"/api/v1/jobs/{broken}/events").json()
    retried = next(e["time"] for e in events if e["to_state"] == "retrying")
    resubmitted = [e["time"] for e in events if e["to_state"] == "submitted"][1]
    waited = (datetime.fromisoformat(resubmitted) - datetime.fromisoformat(retried)).total_seconds()
    print(f"\nbackoff 3 s: the retry went out {waited:.2f} s after attempt 1 ended")
    assert waited >= 3
    first = attempts(api, broken)[0]
    assert (first["state"], first["kind"]) == ("failed", "failure")
    assert "failing on purpose after epoch 0's checkpoint (attempt 1)" in first["reason"]


def test_a_rank_killed_on_slurm_is_a_node_failure_and_the_job_is_retried(api: Api) -> None:
    """Also: a job that runs after it, on the local backend, waits out the retry (only the final
    outcome counts) and then gets the second attempt's result and checkpoint as its upstream."""
    job_id = api.submit(name="killed", entrypoint=TRAIN, retries=FAST_RETRIES, restarts={"max": 0},
                        kwargs={**KWARGS, "sleep_per_step": 0.3},
                        resources={"nodes": 2, "tasks_per_node": 1, "timeout_min": 5})["id"]  # fmt: skip
    dependent = api.submit(name="after-killed", entrypoint=UPSTREAM_ECHO, backend="local", after=[job_id])
    assert dependent["state"] == "waiting", dependent
    job = first_checkpoint(api, job_id)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    wait_for(lambda: api.job(job_id)["state"] == "retrying", 120, "the retry")
    assert api.job(dependent["id"])["state"] == "waiting"  # a retrying dependency has not ended

    done = api.finished(job_id, timeout=240)
    after = api.finished(dependent["id"], timeout=120)

    first = attempts(api, job_id)[0]
    print(f"\nattempt 1: {first['state']} {first['kind']} exit {first['exit_code']}: {first['reason'][:300]}")
    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 2 and done["result"]["resumed_from_epoch"] is not None
    assert (first["state"], first["kind"]) == ("failed", "node_failure"), first
    assert first["reason"].startswith("rank 1 on n2"), first["reason"]
    assert first["nodes"] == "n[1-2]" and first["external_id"] != done["external_id"]
    for placed in (first["placement"], done["placement"]):  # where the ranks said they ran
        assert [(p["rank"], p["host"]) for p in placed] == [(0, "n1"), (1, "n2")]
    wait_for(lambda: not processes_in(job["folder"]), 30, "every process of the job to be gone")
    assert after["state"] == "succeeded", after["reason"]
    [upstream] = after["result"]
    assert (upstream["job_id"], upstream["state"]) == (job_id, "succeeded")
    assert upstream["result"] == done["result"] and upstream["checkpoint"] == done["latest_checkpoint"]
    events = api.get(f"/api/v1/jobs/{dependent['id']}/events").json()
    waited = [event for event in events if event["to_state"] == "queued"]
    assert datetime.fromisoformat(waited[0]["time"]) >= datetime.fromisoformat(done["finished_at"])


def processes_in(folder: str) -> list[int]:
    """Live processes whose command line names the job's folder (the ranks of every attempt do)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            ours = entry.name.isdigit() and folder.encode() in (entry / "cmdline").read_bytes()
            if ours and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def test_a_node_that_dies_under_a_two_node_job_is_a_node_failure_retried_once_it_is_back(api: Api) -> None:
    """n2 dies whole (its slurmd and every process in its namespace, SIGKILL): the rank on n1 loses
    its peer, the attempt is a node failure naming n2, and the retry, after a backoff long enough for
    n2 to come back, runs on both nodes again."""
    job_id = api.submit(name="node-dies", entrypoint=TRAIN, retries={**FAST_RETRIES, "backoff_s": 30},
                        restarts={"max": 0},
                        kwargs={**KWARGS, "sleep_per_step": 0.3},
                        resources={"nodes": 2, "tasks_per_node": 1, "timeout_min": 5})["id"]  # fmt: skip
    first_checkpoint(api, job_id)
    killed = kill_node("n2")
    try:
        retrying = wait_for(lambda: (j := api.job(job_id))["state"] == "retrying" and j, 120, "a retry")
    finally:
        revive_node("n2")

    done = api.finished(job_id, timeout=300)

    first = attempts(api, job_id)[0]
    print(f"\nkilled {killed} processes of n2; attempt 1: {first['kind']}: {first['reason'][:200]}")
    assert retrying["attempt"] == 2
    assert (first["state"], first["kind"]) == ("failed", "node_failure"), first
    assert first["reason"].startswith("rank 1 on n2 vanished"), first["reason"]
    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 2 and done["result"]["world_size"] == 2
    assert done["nodes"] == "n[1-2]"


def revive_node(name: str) -> None:
    """Start the node's slurmd again (deploy/slurm/up.sh; its own wait may give up while the controller
    still has the node down), resume it, and wait until the controller can place jobs on it."""
    subprocess.run(["bash", "deploy/slurm/up.sh", "--nodes", "2", "--no-smoke"], cwd=ROOT,
                   capture_output=True, timeout=180)  # fmt: skip
    resume = ["scontrol", "update", f"nodename={name}", "state=resume"]
    subprocess.run(resume, capture_output=True, timeout=30)

    def usable() -> bool:
        asked = ["sinfo", "-h", "-n", name, "-o", "%T"]
        done = subprocess.run(asked, capture_output=True, text=True, timeout=30)
        return done.stdout.strip() in ("idle", "mixed", "allocated", "completing")

    wait_for(usable, 90, f"{name} to take jobs again")


def kill_node(name: str) -> int:
    """SIGKILL the node's slurmd and everything in its network namespace (its job steps and ranks);
    how many processes that was."""
    slurmd = int(Path(f"/run/slurm/slurmd-{name}.pid").read_text().strip())
    namespace = os.readlink(f"/proc/{slurmd}/ns/net")
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "ns" / "net") != namespace:
                continue
            os.kill(int(entry.name), signal.SIGKILL)
            killed += 1
        except (OSError, ProcessLookupError):
            continue
    return killed


def test_a_service_killed_during_the_backoff_and_during_the_retrys_sbatch_makes_exactly_one_retry(
    tmp_path: Path,
) -> None:
    """SIGKILL while the retry waits its backoff, then again while the retry's sbatch runs: the third
    service adopts what that sbatch queued. SLURM's accounting holds two jobs: the attempts, no more."""
    database = f"sqlite:///{tmp_path / 'ledger.db'}"
    data = tmp_path / "data"
    started, slow = tmp_path / "sbatch-started", tmp_path / "slow"
    env = service_env(data, database, default_backend="slurm", reconcile_interval_s="1",
                      dispatch_interval_s="0.5")  # fmt: skip
    env["PATH"] = f"{slow_sbatch(tmp_path / 'bin', started, 4, only_while=slow)}:{env['PATH']}"
    token = ledger_token(database)
    since = slurm_now()
    body = {
        "name": "killed-twice",
        "entrypoint": TRAIN,
        "kwargs": {**KWARGS, "epochs": 2, "fail_on_attempts": [1]},
        "retries": {"max": 2, "backoff_s": 6, "on": ["failure"]},
        "resources": {"timeout_min": 5},
    }
    services: list[ServiceProcess] = []
    try:
        services.append(ServiceProcess(env, tmp_path / "a.log", cwd=tmp_path / "cwd"))
        api = Api(services[-1].url, token)
        job_id = api.submit(**body)["id"]
        wait_for(lambda: api.job(job_id)["state"] == "retrying", 180, "attempt 1 to end in a retry")
        services[-1].kill()  # during the backoff

        slow.touch()  # the next sbatch takes its time: a window to kill the service in
        services.append(ServiceProcess(env, tmp_path / "b.log", cwd=tmp_path / "cwd"))
        wait_for(started.exists, 60, "the retry's sbatch to start")
        services[-1].kill()  # during the retry's submission
        slow.unlink()

        services.append(ServiceProcess(env, tmp_path / "c.log", cwd=tmp_path / "cwd"))
        api = Api(services[-1].url, token)
        done = api.finished(job_id, timeout=240)
        history = attempts(api, job_id)
        reasons = [event["reason"] for event in api.get(f"/api/v1/jobs/{job_id}/events").json()]

        def accounted() -> list[str] | None:
            ids = sorted(row["id"] for row in sacct_jobs(since, data))
            return ids if done["external_id"] in ids else None

        slurm_jobs = wait_for(accounted, 60, "the attempts in SLURM's accounting")
    finally:
        for service in services:
            service.stop()

    assert done["state"] == "succeeded" and done["attempt"] == 2, done["reason"]
    assert [(a["attempt"], a["state"], a["kind"]) for a in history] == [(1, "failed", "failure"),
                                                                        (2, "succeeded", None)]  # fmt: skip
    assert "adopted after a dispatcher restart" in reasons, reasons
    assert slurm_jobs == sorted([history[0]["external_id"], done["external_id"]])  # one retry, not two
