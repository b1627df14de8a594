"""Retries of real training on the local backend: real processes, real torch, real gloo.

- A run that raises right after its first checkpoint on attempt 1 (`on: ["failure"]`) succeeds on
  attempt 2 after the backoff, resumed from that checkpoint, with parameters equal bit for bit to an
  uninterrupted run of the same job.
- A rank SIGKILLed mid-training: its peers lose it, the attempt is a node failure (the lost rank
  named), the default policy retries it, attempt 2 succeeds, and no process of the job is left.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from tests.integration.test_faults_local import assert_nothing_left, ended
from tests.serving import LiveServer, serve
from tests.support import rank_pid, wait_for

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"
TRAIN = {"entrypoint": "worker.tasks.train:train", "resources": {"tasks_per_node": 2}}
KWARGS = {"epochs": 3, "samples": 256, "batch_size": 32, "seed": 3}
BACKOFF_S = 2.0


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


def attempts(client: httpx.Client, job_id: int) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = client.get(f"{JOBS}/{job_id}/attempts").raise_for_status().json()
    return found


def event_time(client: httpx.Client, job_id: int, state: str, nth: int = 0) -> datetime:
    events = client.get(f"{JOBS}/{job_id}/events").raise_for_status().json()
    return datetime.fromisoformat([e["time"] for e in events if e["to_state"] == state][nth])


def test_a_run_that_breaks_after_a_checkpoint_is_retried_and_ends_as_an_uninterrupted_one(
    live: httpx.Client,
) -> None:
    retries = {"max": 2, "backoff_s": BACKOFF_S, "backoff_factor": 1, "on": ["failure"]}
    broken = submit(live, "breaks", retries=retries, kwargs={**KWARGS, "fail_on_attempts": [1]})
    whole = submit(live, "whole", kwargs=KWARGS)

    done, reference = ended(live, broken, 240), ended(live, whole, 240)

    assert done["state"] == "succeeded", done["reason"]
    assert reference["state"] == "succeeded", reference["reason"]
    assert done["attempt"] == 2 and reference["attempt"] == 1
    assert done["result"]["resumed_from_epoch"] == 0 and done["result"]["epochs_run"] == 2
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]  # bit for bit
    first, second = attempts(live, broken)
    assert (first["state"], first["kind"]) == ("failed", "failure")
    assert "failing on purpose after epoch 0's checkpoint (attempt 1)" in first["reason"]
    assert (second["state"], second["kind"]) == ("succeeded", None)
    waited = (event_time(live, broken, "submitted", 1) - event_time(live, broken, "retrying")).total_seconds()
    print(f"\nbackoff {BACKOFF_S} s, waited {waited:.2f} s between the retry and its submission")
    assert BACKOFF_S <= waited < BACKOFF_S + 2.5  # the backoff, then the next dispatch tick


def test_a_rank_killed_mid_training_is_a_node_failure_and_the_job_is_retried(live: httpx.Client) -> None:
    job_id = submit(
        live,
        "killed",
        retries={"max": 2, "backoff_s": 1},  # the default kinds: node_failure and preemption
        restarts={"max": 0},  # no restart in place (tests/integration/test_restarts_local.py has those)
        kwargs={**KWARGS, "epochs": 4, "sleep_per_step": 0.25},
    )
    job = wait_for(lambda: (j := live.get(f"{JOBS}/{job_id}").json())["latest_checkpoint"] and j, 180,
                   "the first checkpoint")  # fmt: skip
    victim = rank_pid(job, 1)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()

    done = ended(live, job_id, 240)

    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 2
    assert done["result"]["resumed_from_epoch"] is not None  # resumed from a checkpoint, not from scratch
    first = attempts(live, job_id)[0]
    assert (first["state"], first["kind"]) == ("failed", "node_failure"), first
    assert first["reason"].startswith("rank 1 on "), first["reason"]
    assert "vanished (rank 0 on " in first["reason"]
    assert first["nodes"] == os.uname().nodename
    here = os.uname().nodename
    for placed in (first["placement"], done["placement"]):  # the ranks' own word, each attempt's
        ranks = [(p["rank"], p["host"], p["local_rank"], p["gpu"]) for p in placed]
        assert ranks == [(0, here, 0, None), (1, here, 1, None)]
    print(f"\nrank 1 killed; the job succeeded on attempt 2 {time.monotonic() - killed_at:.1f} s later")
    assert_nothing_left(done)

