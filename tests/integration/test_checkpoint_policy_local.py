"""Checkpoint policies on real training (local backend, real processes, real torch and gloo).

- A 6-epoch run with `keep_last: 2` whose rank 1 is SIGKILLed after its third checkpoint: the retry
  resumes from the newest checkpoint left, ends bit for bit as an uninterrupted run, and exactly two
  checkpoints remain, listed and downloadable through the API.
- `keep_last: 1` with `keep_best` on the loss, on a run that diverges: what is left is the newest and
  the lowest-loss one of all the epochs (the loss each was saved with is in the ledger's metrics).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from tests.integration.test_faults_local import ended
from tests.serving import LiveServer, serve
from tests.support import rank_pid, wait_for
from worker.spec import JobFiles

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"
STEPS_PER_EPOCH = 4  # 256 samples, batches of 32, 2 ranks
KWARGS = {"epochs": 6, "samples": 256, "batch_size": 32, "seed": 11, "report_every": 0}


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
    job = {"name": name, "entrypoint": "worker.tasks.train:train", "resources": {"tasks_per_node": 2}, **body}
    response = client.post(JOBS, json=job)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def checkpoint_files(job: dict[str, Any]) -> list[str]:
    return [path.name for _, path in JobFiles(Path(job["folder"])).saved_checkpoints()]


def test_keep_last_2_leaves_two_checkpoints_and_a_run_killed_mid_way_resumes_bit_for_bit(
    live: httpx.Client,
) -> None:
    slow = {**KWARGS, "sleep_per_step": 0.25}  # about a second an epoch: time to kill it mid-run
    kept = submit(live, "keep-last-2", kwargs=slow, checkpoints={"keep_last": 2},
                  retries={"max": 2, "backoff_s": 1}, restarts={"max": 0})  # fmt: skip
    whole = submit(live, "whole", kwargs=KWARGS)

    def third_checkpoint() -> dict[str, Any] | None:
        job: dict[str, Any] = live.get(f"{JOBS}/{kept}").raise_for_status().json()
        latest = job["latest_checkpoint"]
        return job if latest and int(Path(latest).stem.split("-")[1]) >= 3 * STEPS_PER_EPOCH else None

    mid = wait_for(third_checkpoint, 180, "the third checkpoint")
    assert len(checkpoint_files(mid)) == 2, "older checkpoints go as the job runs"
    os.kill(rank_pid(mid, 1), signal.SIGKILL)

    done, reference = ended(live, kept, 240), ended(live, whole, 240)
    assert done["state"] == "succeeded", done["reason"]
    assert reference["state"] == "succeeded", reference["reason"]
    assert done["attempt"] == 2 and done["result"]["resumed_from_epoch"] is not None
    assert done["result"]["epochs_run"] < 6
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]  # bit for bit

    last_two = [f"ckpt-{5 * STEPS_PER_EPOCH:08d}.pt", f"ckpt-{6 * STEPS_PER_EPOCH:08d}.pt"]
    assert checkpoint_files(done) == last_two
    assert len(checkpoint_files(reference)) == 6  # no policy: every epoch's
    listed = live.get(f"{JOBS}/{kept}/checkpoints").raise_for_status().json()
    assert [c["name"] for c in listed] == last_two
    newest = Path(done["folder"]) / "checkpoints" / last_two[1]
    downloaded = live.get(f"{JOBS}/{kept}/checkpoints/{last_two[1]}")
    assert downloaded.status_code == 200 and downloaded.content == newest.read_bytes()


def test_keep_best_keeps_the_lowest_loss_checkpoint_besides_the_newest(live: httpx.Client) -> None:
    policy = {"keep_last": 1, "keep_best": {"metric": "loss", "goal": "min"}}
    # A learning rate so high that the run diverges after its first epoch: the best is not the newest.
    job_id = submit(live, "keep-best", kwargs={**KWARGS, "lr": 1.0}, checkpoints=policy)

    done = ended(live, job_id, 240)

    assert done["state"] == "succeeded", done["reason"]
    metrics = live.get(f"{JOBS}/{job_id}/metrics", params={"name": "loss"}).raise_for_status().json()
    loss_at = {m["step"]: m["value"] for m in metrics}  # one report per epoch, at its checkpoint's step
    steps = [epoch * STEPS_PER_EPOCH for epoch in range(1, 7)]
    # A loss that overflowed to infinity is reported as null and stored as no value: on some CPUs
    # the divergence gets there within six epochs. The epochs that have one are a prefix of them all.
    assert sorted(loss_at) == steps[: len(loss_at)] and len(loss_at) >= 2
    best = min(loss_at, key=lambda step: (loss_at[step], step))
    assert best != steps[-1], "the run was meant to diverge"
    expected = [best, steps[-1]]
    assert checkpoint_files(done) == [f"ckpt-{step:08d}.pt" for step in expected]
    listed = live.get(f"{JOBS}/{job_id}/checkpoints").raise_for_status().json()
    assert [c["metrics"].get("loss") for c in listed] == [loss_at.get(step) for step in expected]
    print(f"\nepoch losses {[round(loss_at[s], 4) for s in steps]}; kept {expected}")
