"""Restarts in place on the local backend: real processes, real torch, real gloo, a real kill -9.

- A rank of a 3-rank training run killed mid-run: the supervisor stops the others and starts every
  rank again from the newest checkpoint, in the same attempt (no trip through the queue), and the
  run ends with the parameters of an uninterrupted run, bit for bit.
- Restarts spent: the attempt ends, `retries` requeues it, and the result is still bit for bit.
- A cancel while the ranks restart ends the job and leaves no process behind.
- A service SIGKILLed as a rank is lost: the supervisor restarts the ranks alone, and the service
  started again tells the restart once and ends the job bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.ledger.db import make_engine
from tests.cli_service import clean_env
from tests.integration.test_faults_local import assert_nothing_left, ended
from tests.integration.test_service_local import start_service
from tests.serving import LiveServer, free_port, serve
from tests.support import bearer, issue_token, rank_pid, wait_for

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"
TRAIN = {"entrypoint": "worker.tasks.train:train", "resources": {"tasks_per_node": 3}}
KWARGS = {"epochs": 4, "samples": 192, "batch_size": 16, "seed": 5, "report_every": 1}
SLOW = {**KWARGS, "sleep_per_step": 0.2}  # about a second an epoch: time to kill a rank mid-run


@pytest.fixture
def live(tmp_path: Path) -> Iterator[httpx.Client]:
    settings = Settings(
        job_accounts="service",
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path}/ledger.db",
        local_reconcile_interval_s=0.2,
        dispatch_interval_s=0.2,
    )
    server: LiveServer
    with serve(create_app(settings)) as server, server.client("alice") as client:
        yield client


def submit(client: httpx.Client, name: str, **body: Any) -> int:
    response = client.post(JOBS, json={"name": name, **TRAIN, **body})
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def restart_records(job: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(job["folder"]) / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def progress_times(job: dict[str, Any]) -> list[dict[str, Any]]:
    lines = (Path(job["folder"]) / "progress.jsonl").read_text().splitlines()
    return [record for line in lines if "step" in (record := json.loads(line)) and "checkpoint" not in record]


def after_first_checkpoint(client: httpx.Client, job_id: int) -> dict[str, Any]:
    return wait_for(lambda: (j := client.get(f"{JOBS}/{job_id}").json())["latest_checkpoint"] and j, 180,
                    "the first checkpoint")  # fmt: skip


def test_a_rank_killed_mid_run_restarts_in_place_and_ends_bit_for_bit(live: httpx.Client) -> None:
    job_id = submit(live, "killed", kwargs=SLOW)
    whole = submit(live, "whole", kwargs=KWARGS)
    job = after_first_checkpoint(live, job_id)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    killed_at = time.time()

    done, reference = ended(live, job_id, 240), ended(live, whole, 240)

    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 1 and done["external_id"] == job["external_id"]  # no trip through the queue
    assert done["result"]["resumed_from_epoch"] is not None  # from a checkpoint, not from the start
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]  # bit for bit
    [record] = restart_records(done)
    assert (record["attempt"], record["restart"], record["outcome"]) == (1, 1, "restarted")
    assert (record["cause"], record["rank"], record["detail"]) == ("node_failure", 1, "killed by SIGKILL")
    assert record["resumed_step"] is not None and record["max"] == 2
    first_after = min(p["time"] for p in progress_times(done) if p["time"] > record["started_at"])
    print(f"\nrank 1 killed: stopped {record['lost_at'] - killed_at:.2f} s later, ranks started again "
          f"{record['started_at'] - record['lost_at']:.2f} s after that, first step after the restart "
          f"{first_after - killed_at:.2f} s after the kill")
    assert first_after - killed_at <= 10.0
    assert_nothing_left(done)


def test_restarts_spent_end_the_attempt_and_retries_requeue_it_bit_for_bit(live: httpx.Client) -> None:
    job_id = submit(live, "spent", kwargs=SLOW, restarts={"max": 1}, retries={"max": 1, "backoff_s": 0.5})
    whole = submit(live, "whole", kwargs=KWARGS)
    job = after_first_checkpoint(live, job_id)
    for victim in (1, 2):  # the first loss is restarted in place, the second spends the restarts
        os.kill(rank_pid(job, victim), signal.SIGKILL)
        wait_for(lambda n=victim: len(restart_records(job)) >= n, 60, f"restart record {victim}")  # type: ignore[misc]
        if victim == 1:
            wait_for(lambda: _running_again(job), 60, "the ranks to run again")

    done, reference = ended(live, job_id, 240), ended(live, whole, 240)

    restarted, gave_up = restart_records(done)[:2]
    assert (restarted["outcome"], gave_up["outcome"]) == ("restarted", "gave_up")
    assert gave_up["reason"] == "restarts spent (1 of 1)", gave_up
    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 2  # requeued by retries
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]


def _running_again(job: dict[str, Any]) -> bool:
    try:
        rank_pid(job, 2)
    except AssertionError:
        return False
    record = restart_records(job)[-1]
    return any(p["time"] > record["started_at"] for p in progress_times(job))


def test_a_cancel_during_a_restart_ends_the_job(live: httpx.Client) -> None:
    job_id = submit(live, "cancelled", kwargs=SLOW)
    job = after_first_checkpoint(live, job_id)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    wait_for(lambda: restart_records(job), 60, "the restart")
    live.post(f"{JOBS}/{job_id}/cancel").raise_for_status()

    done = ended(live, job_id, 60)

    assert done["state"] == "cancelled", done
    assert_nothing_left(done)


def test_a_rank_killed_while_rank_0_writes_a_checkpoint_resumes_from_the_one_before(
    live: httpx.Client,
) -> None:
    # A model whose checkpoint (weights and momentum, ~270 MB) takes a while to write.
    big = {**KWARGS, "width": 4096, "depth": 2, "samples": 96, "batch_size": 16, "sleep_per_step": 0}
    job_id = submit(live, "mid-write", kwargs=big)
    job = after_first_checkpoint(live, job_id)
    first = Path(job["latest_checkpoint"]).name
    checkpoints = Path(job["folder"]) / "checkpoints"

    def writing() -> bool:  # the writer's temp file of the second checkpoint
        return any(path.name.startswith(".ckpt-") and ".tmp-" in path.name for path in checkpoints.iterdir())

    deadline = time.monotonic() + 120
    while not writing():  # a tight look: the write lasts a fraction of a second
        assert time.monotonic() < deadline, "rank 0 never wrote a second checkpoint"
        time.sleep(0.002)
    os.kill(rank_pid(job, 1), signal.SIGKILL)
    record = wait_for(lambda: restart_records(job) and restart_records(job)[0], 60, "the restart")

    assert Path(record["resumed_from"]).name == first, record  # the half-written one is not whole
    done = ended(live, job_id, 300)
    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 1


def test_a_service_killed_during_a_restart_loses_nothing(tmp_path: Path) -> None:
    """The supervisor restarts in place with no service watching; the service started again reads the
    restart once from restarts.jsonl and the job ends as if it had watched throughout."""
    ledger = f"sqlite:///{tmp_path}/ledger.db"
    env = clean_env(TORCHYARD_DATA_DIR=str(tmp_path / "data"), TORCHYARD_DATABASE_URL=ledger,
                    TORCHYARD_LOCAL_RECONCILE_INTERVAL_S="0.2")
    port = free_port()
    first = start_service(env, port)
    engine = make_engine(ledger)
    try:
        headers = bearer(issue_token(engine, "alice"))  # in the ledger: the second service knows it
    finally:
        engine.dispose()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as client:
        try:
            job_id = submit(client, "killed", kwargs=SLOW)
            whole = submit(client, "whole", kwargs=KWARGS)
            job = after_first_checkpoint(client, job_id)
            os.kill(rank_pid(job, 1), signal.SIGKILL)
        finally:
            first.send_signal(signal.SIGKILL)  # at once: the restart happens while no service runs
            first.wait()
        wait_for(lambda: restart_records(job), 60, "the supervisor's restart record")
        second = start_service(env, port)
        try:
            done, reference = ended(client, job_id, 240), ended(client, whole, 240)
            events = client.get(f"{JOBS}/{job_id}/events").raise_for_status().json()
        finally:
            second.terminate()
            second.wait(timeout=30)

    assert done["state"] == "succeeded", done["reason"]
    assert (done["attempt"], done["restart_count"]) == (1, 1)
    restarted = [event for event in events if "restarted in place" in (event["reason"] or "")]
    assert len(restarted) == 1, events  # read once, though the first service never saw it
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]
    assert_nothing_left(done)
