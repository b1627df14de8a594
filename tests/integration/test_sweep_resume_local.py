"""A trial early_stop stopped, resumed (`sweep resume ID --trial N`), with real processes and real
torch on the local backend: it ends with the parameters, bit for bit, of the same training never
stopped (worker.tasks.train resumes exactly from an epoch's checkpoint)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from tests.integration.test_faults_local import ended
from tests.integration.test_sweep_pruning_local import INTERVALS, finished
from tests.serving import LiveServer, serve
from tests.support import wait_for

pytestmark = pytest.mark.integration

SWEEPS = "/api/v1/sweeps"
# 256 samples / 32 a batch: 8 steps an epoch, a checkpoint after each; 4 epochs are 32 steps.
KWARGS = {"epochs": 4, "samples": 256, "batch_size": 32, "seed": 3, "report_every": 2, "sleep_per_step": 0.1}
SWEEP = {
    "name": "train",
    "job": {"entrypoint": "worker.tasks.train:train", "kwargs": KWARGS},
    "grid": {"lr": [0.05, 0.001]},  # one after the other: the slow learner is behind at step 12
    "max_parallel": 1,
    "early_stop": {"method": "asha", "min_steps": 12, "reduction_factor": 2, "max_steps": 32},
}


@pytest.fixture
def live(tmp_path: Path) -> Iterator[httpx.Client]:
    settings = Settings(
        job_accounts="service",
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path}/ledger.db",
        **INTERVALS,
    )
    server: LiveServer
    with serve(create_app(settings)) as server, server.client("alice") as client:
        yield client


def test_a_resumed_trial_ends_as_one_never_stopped(live: httpx.Client) -> None:
    response = live.post(SWEEPS, json=SWEEP)
    assert response.status_code == 201, response.text
    sweep_id = response.json()["id"]
    sweep = finished(live, sweep_id, timeout=240)
    best, stopped = sweep["trials"]
    assert (best["state"], stopped["ending"]) == ("succeeded", "pruned"), sweep["trials"]
    assert stopped["reason"].startswith("pruned at rung 0 (step 12)")
    stopped_job = live.get(f"/api/v1/jobs/{stopped['job_id']}").json()
    assert stopped_job["latest_checkpoint"], stopped_job  # stopped past its first epoch's checkpoint

    resumed = live.post(f"{SWEEPS}/{sweep_id}/trials/1/resume")
    assert resumed.status_code == 201, resumed.text
    new_id = resumed.json()["trials"][1]["job_id"]
    assert new_id != stopped["job_id"]
    never_stopped = {"name": "never-stopped", "entrypoint": "worker.tasks.train:train",
                     "kwargs": {**KWARGS, "lr": 0.001}}  # fmt: skip
    reference = live.post("/api/v1/jobs", json=never_stopped)
    assert reference.status_code == 201, reference.text

    done: dict[str, Any] = ended(live, new_id, 240)
    whole: dict[str, Any] = ended(live, reference.json()["id"], 240)
    assert done["state"] == "succeeded" and whole["state"] == "succeeded", (done["reason"], whole["reason"])
    assert done["result"]["resumed_from_epoch"] is not None  # it continued, it did not start over
    assert done["result"]["steps"] == whole["result"]["steps"] == 32
    assert done["result"]["param_checksum"] == whole["result"]["param_checksum"]  # bit for bit
    after = wait_for(lambda: (s := live.get(f"{SWEEPS}/{sweep_id}").json())["state"] == "finished" and s, 30,
                     "the sweep finished")  # fmt: skip
    assert [trial["state"] for trial in after["trials"]] == ["succeeded", "succeeded"]
    assert after["trials"][1]["steps"] == 32
