"""Ranks that fail on purpose, through the whole local path: REST -> ledger -> submitit -> real ranks.

Three faults, submitted together to one service (each job pays seconds of torch imports on 2 cores):
- a rank that raises mid-job,
- a rank that ends its process with a non-zero status (no traceback, like a crash),
- a rank that never reaches the rendezvous (stuck in its imports for far longer than the test runs),
  so the others time out after Settings.rendezvous_timeout_s, which reaches the ranks in their spec.
Each must end `failed` within its bound, keep the reason and the ranks' logs, and leave no process
of the job running.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.states import TERMINAL_STATE_NAMES
from tests.serving import LiveServer, serve
from tests.support import wait_for

pytestmark = pytest.mark.integration

RENDEZVOUS_TIMEOUT_S = 15.0
STALL_S = 600  # far past every bound below: a job that waited it out would fail the test by timing out
NUL = b"\0"
HOST = os.uname().nodename  # where local ranks run, as their placement and the reasons say
# Bounds from `running` to `failed`: torch imports on a loaded 2-core machine take most of them.
PROMPT_S = 60.0
STALLED_S = RENDEZVOUS_TIMEOUT_S + 60.0

FAULTS: dict[str, dict[str, Any]] = {
    "raises": {
        "entrypoint": "worker.tasks.faults:raise_on_rank",
        "kwargs": {"rank": 1, "message": "boom from rank one"},
    },
    "exits": {"entrypoint": "worker.tasks.faults:exit_on_rank", "kwargs": {"rank": 1, "code": 3}},
    "stalls": {
        "entrypoint": "worker.tasks.faults:sleep",
        "kwargs": {"seconds": 1},
        "env": {"STALL_BEFORE_RENDEZVOUS": f"1:{STALL_S}"},  # see worker.tasks.faults
    },
}


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[httpx.Client, dict[str, int]]]:
    """One service with the three faulty jobs submitted at once: (client, job id by fault)."""
    tmp = tmp_path_factory.mktemp("faults")
    settings = Settings(
        job_accounts="service",
        data_dir=tmp / "data",
        database_url=f"sqlite:///{tmp}/ledger.db",
        rendezvous_timeout_s=RENDEZVOUS_TIMEOUT_S,
        local_reconcile_interval_s=0.2,
        allowed_env_keys=["STALL_BEFORE_RENDEZVOUS"],  # the operator lets jobs ask for the fault
    )
    server: LiveServer
    with serve(create_app(settings)) as server, server.client("alice") as client:
        ids = {}
        for fault, body in FAULTS.items():
            # No retries: these check how the first attempt's fault is told (retries: test_retries_local).
            job = {"name": fault, "resources": {"tasks_per_node": 2}, "retries": {"max": 0}, **body}
            response = client.post("/api/v1/jobs", json=job)
            assert response.status_code == 201, response.text
            ids[fault] = response.json()["id"]
        yield client, ids


def ended(client: httpx.Client, job_id: int, timeout: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"/api/v1/jobs/{job_id}").raise_for_status().json()
        return job if job["state"] in TERMINAL_STATE_NAMES else None

    return wait_for(probe, timeout, f"job {job_id} to end")


def run_time_s(job: dict[str, Any]) -> float:
    started = datetime.fromisoformat(job["started_at"] or job["submitted_at"])
    return (datetime.fromisoformat(job["finished_at"]) - started).total_seconds()


def log(client: httpx.Client, job_id: int, rank: int) -> str:
    response = client.get(f"/api/v1/jobs/{job_id}/logs", params={"rank": rank, "stream": "err"})
    assert response.status_code == 200, response.text
    return response.text


def processes_of(job: dict[str, Any]) -> list[str]:
    """Live processes of the job: its folder on their command line (the controller and the ranks name
    their submitit folder), or its controller's id in their environment (anything the ranks started)."""
    folder = job["folder"].encode()
    marker = f"SUBMITIT_LOCAL_JOB_ID={job['external_id']}".encode() + NUL
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except (OSError, IndexError):
            continue  # gone meanwhile, or a kernel thread
        if folder in cmdline or marker in environ:
            found.append(f"{entry.name}: {cmdline.replace(NUL, b' ').decode(errors='replace')}")
    return found


def assert_nothing_left(job: dict[str, Any]) -> None:
    # The service ends the survivors on its own (SIGINT, then SIGKILL 3 s later): give it that long.
    wait_for(lambda: not processes_of(job), 15, f"job {job['id']}'s processes to exit")


def test_a_raising_rank_fails_the_job_with_its_traceback_and_logs(
    faulty: tuple[httpx.Client, dict[str, int]],
) -> None:
    client, ids = faulty
    job = ended(client, ids["raises"], 120)
    assert job["state"] == "failed", job
    assert run_time_s(job) < PROMPT_S  # not the 15 s rendezvous timeout or more: the peer failed at once
    assert job["reason"].startswith(f"rank 1 on {HOST} raised:")
    assert "Traceback" in job["reason"] and "RuntimeError: boom from rank one (rank 1)" in job["reason"]
    rank1 = log(client, job["id"], 1)
    assert "Traceback" in rank1 and "RuntimeError: boom from rank one (rank 1)" in rank1
    assert_nothing_left(job)


def test_a_rank_that_exits_nonzero_fails_the_job_promptly(
    faulty: tuple[httpx.Client, dict[str, int]],
) -> None:
    client, ids = faulty
    job = ended(client, ids["exits"], 120)
    assert job["state"] == "failed", job
    assert run_time_s(job) < PROMPT_S
    # os._exit leaves no traceback: the reason names the rank that vanished and what its peer saw.
    assert job["reason"].startswith(f"rank 1 on {HOST} vanished (rank 0 on {HOST} lost it):"), job["reason"]
    assert "by peer" in job["reason"], job["reason"]
    assert "exiting with status 3 on purpose" in log(client, job["id"], 1)
    assert_nothing_left(job)


def test_a_rank_that_never_reaches_the_rendezvous_fails_the_job_after_the_timeout(
    faulty: tuple[httpx.Client, dict[str, int]],
) -> None:
    client, ids = faulty
    job = ended(client, ids["stalls"], STALLED_S + 60)
    assert job["state"] == "failed", job
    took = run_time_s(job)
    assert RENDEZVOUS_TIMEOUT_S <= took < STALLED_S, f"{took:.0f} s"
    # Rank 0 hosted the store and waited for rank 1 to join for the spec's timeout, then gave up: a
    # peer lost at the rendezvous, the kind a retry policy's node_failure covers.
    assert job["reason"].startswith(f"rank 1 on {HOST} vanished (rank 0 on {HOST} lost it):"), job["reason"]
    assert f"wait timeout after {RENDEZVOUS_TIMEOUT_S * 1000:.0f}ms" in job["reason"], job["reason"]
    assert "Traceback" in log(client, job["id"], 0)
    assert "stalling 600 s before the rendezvous on purpose" in log(client, job["id"], 1)
    # The setting reached the ranks through the spec the dispatcher wrote into the job folder.
    spec = json.loads((Path(job["folder"]) / "spec.json").read_text())
    assert spec["rendezvous_timeout_s"] == RENDEZVOUS_TIMEOUT_S
    assert_nothing_left(job)
