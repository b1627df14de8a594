"""Sweeps on the real cluster, through a real service process: a grid goes out as ONE job array with
SLURM's `%` throttle, is cut under MaxArraySize, is cancelled with one scancel, and survives a SIGKILL
of the service in the middle of its sbatch with every trial run exactly once.

The scheduler commands are counted by wrappers first on the service's PATH (the service runs `sbatch`
and `scancel` by name), so the counts are the scheduler's calls, not the service's own word.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.states import TERMINAL_STATE_NAMES
from tests.integration.slurm.conftest import (
    Api,
    ServiceProcess,
    ledger_token,
    sacct_jobs,
    scancel,
    service_env,
    slurm_now,
    submissions,
)
from tests.integration.slurm.test_faults_slurm import ledger_states, slow_sbatch
from tests.support import wait_for

pytestmark = pytest.mark.slurm

SWEEPS = "/api/v1/sweeps"
TRAIN = "worker.tasks.train:train"
QUICK = {"epochs": 2, "samples": 64, "report_every": 1}
FIVE_MIN = {"timeout_min": 5}
SLURM_CONF = Path("/etc/slurm/slurm.conf")


def counted_commands(folder: Path, log: Path, *names: str) -> Path:
    """Wrappers for `names` that append each real call (not `sbatch --test-only`) to `log`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        real = shutil.which(name)
        assert real is not None, name
        wrapper = folder / name
        wrapper.write_text(
            f'#!/bin/bash\n[[ " $* " != *" --test-only "* ]] && echo {name} >> {log}\nexec {real} "$@"\n'
        )
        wrapper.chmod(0o755)
    return folder


def calls(log: Path, name: str) -> int:
    return log.read_text().split().count(name) if log.exists() else 0


class Service:
    """A service process on SLURM whose sbatch and scancel calls are counted in `log`."""

    def __init__(self, tmp_path: Path, *path_first: Path) -> None:
        self.database = tmp_path / "ledger.db"
        self.log = tmp_path / "scheduler-calls.log"
        self.env = service_env(
            tmp_path / "data", f"sqlite:///{self.database}", default_backend="slurm", reconcile_interval_s="1"
        )
        counting = counted_commands(tmp_path / "counting", self.log, "sbatch", "scancel")
        self.env["PATH"] = ":".join(str(one) for one in (*path_first, counting, self.env["PATH"]))
        self.token = ledger_token(f"sqlite:///{self.database}")
        self.workdir = tmp_path / "cwd"
        self.tmp_path = tmp_path
        self.since = slurm_now()
        self.process: ServiceProcess | None = None

    def start(self, log_name: str = "service.log") -> Api:
        self.process = ServiceProcess(self.env, self.tmp_path / log_name, cwd=self.workdir)
        return Api(self.process.url, self.token)

    def cleanup(self) -> None:
        """Stop the service, and whatever of its jobs SLURM still runs (a failed test leaves no load)."""
        if self.process is not None:
            self.process.stop()
        rows = sacct_jobs(self.since, self.tmp_path / "data")
        scancel(row["id"] for row in rows if row["state"] in ("PENDING", "RUNNING"))


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    one = Service(tmp_path)
    yield one
    one.cleanup()


def launch(api: Api, **body: Any) -> dict[str, Any]:
    response = api.post(SWEEPS, body)
    assert response.status_code == 201, response.text
    sweep: dict[str, Any] = response.json()
    return sweep


def finished(api: Api, sweep_id: int, timeout: float) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        sweep: dict[str, Any] = api.get(f"{SWEEPS}/{sweep_id}").raise_for_status().json()
        return sweep if sweep["state"] == "finished" else None

    return wait_for(probe, timeout, f"sweep {sweep_id} to finish")


def array_ids(api: Api, sweep: dict[str, Any]) -> list[str]:
    """The SLURM array job ids of the sweep's trials (`<array>_<index>` -> `<array>`), once all have one."""

    def probe() -> list[str] | None:
        ids = [api.job(trial["job_id"])["external_id"] for trial in sweep["trials"]]
        return ids if all(ids) else None

    return sorted({one.split("_")[0] for one in wait_for(probe, 60, "every trial submitted")})


def test_a_two_by_three_grid_is_one_throttled_array(service: Service) -> None:
    api = service.start()
    grid = {"lr": [0.01, 0.05], "batch_size": [8, 16, 32]}
    spec: dict[str, Any] = {"entrypoint": TRAIN, "kwargs": QUICK, "resources": FIVE_MIN}
    sweep = launch(api, name="grid", job=spec, grid=grid, max_parallel=2)
    (array,) = array_ids(api, sweep)
    shown = subprocess.run(["scontrol", "show", "job", array], capture_output=True, text=True, timeout=30)
    assert "ArrayTaskThrottle=2" in shown.stdout, shown.stdout[:2000]
    done = finished(api, sweep["id"], timeout=300)
    assert calls(service.log, "sbatch") == 1
    assert done["counts"] == {"succeeded": 6}, done["trials"]
    final_loss = {}
    for trial in done["trials"]:
        job = api.job(trial["job_id"])
        ran = json.loads((Path(job["folder"]) / "spec.json").read_text())  # what rank 0 was given
        assert ran["kwargs"] == {**QUICK, **trial["params"]}
        assert job["result"]["world_size"] == 1 and job["result"]["epochs_run"] == QUICK["epochs"]
        final_loss[trial["job_id"]] = job["result"]["final_loss"]
        assert trial["metric_last"] == pytest.approx(job["result"]["final_loss"])
    assert len(set(final_loss.values())) == 6  # each trial trained with its own parameters
    assert done["best"]["job_id"] == min(final_loss, key=lambda job_id: final_loss[job_id])


@pytest.fixture
def max_array_size_5() -> Iterator[None]:
    """The controller with MaxArraySize=5 (scontrol reconfigure), and back to the deployed value after."""
    deployed = SLURM_CONF.read_text()
    SLURM_CONF.write_text(re.sub(r"(?m)^MaxArraySize=\d+$", "MaxArraySize=5", deployed))
    try:
        subprocess.run(["scontrol", "reconfigure"], check=True, timeout=60)
        wait_for(lambda: "MaxArraySize            = 5" in _config(), 30, "MaxArraySize=5 in force")
        yield
    finally:
        SLURM_CONF.write_text(deployed)
        subprocess.run(["scontrol", "reconfigure"], check=True, timeout=60)
        wait_for(lambda: "MaxArraySize            = 5" not in _config(), 30, "the deployed MaxArraySize")


def _config() -> str:
    return subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout


def test_twelve_trials_under_max_array_size_5_then_one_scancel(
    service: Service, max_array_size_5: None
) -> None:
    api = service.start()
    slow = {**QUICK, "epochs": 50, "sleep_per_step": 1.0}  # still running when cancelled
    spec: dict[str, Any] = {"entrypoint": TRAIN, "kwargs": slow, "resources": FIVE_MIN}
    sweep = launch(api, name="wide", job=spec, grid={"seed": list(range(12))}, max_parallel=4)
    arrays = array_ids(api, sweep)
    assert len(arrays) == 3 and calls(service.log, "sbatch") == 3  # 5 + 5 + 2
    shown = [_throttle(array) for array in arrays]
    assert sorted(shown) == [1, 1, 2]  # max_parallel 4 shared by the three arrays
    wait_for(
        lambda: api.get(f"{SWEEPS}/{sweep['id']}").json()["counts"].get("running"), 120, "a trial running"
    )
    scancels_before = calls(service.log, "scancel")
    cancelled = api.post(f"{SWEEPS}/{sweep['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert calls(service.log, "scancel") == scancels_before + 1
    done = finished(api, sweep["id"], timeout=120)
    assert done["counts"] == {"cancelled": 12}

    def gone() -> bool:
        rows = sacct_jobs(slurm_now(), service.tmp_path / "data")
        return not any(row["state"] in ("PENDING", "RUNNING") for row in rows)

    wait_for(gone, 60, "SLURM to end every element")


def _throttle(array: str) -> int:
    shown = subprocess.run(["scontrol", "show", "job", array], capture_output=True, text=True, timeout=30)
    found = re.search(r"ArrayTaskThrottle=(\d+)", shown.stdout)
    assert found, shown.stdout[:2000]
    return int(found.group(1))


def test_sigkill_in_the_sweeps_sbatch_loses_and_duplicates_no_trial(tmp_path: Path) -> None:
    started = tmp_path / "sbatch-started"
    service = Service(tmp_path, slow_sbatch(tmp_path / "slow", started, 4))
    since = service.since
    try:
        api = service.start("first.log")
        spec: dict[str, Any] = {"entrypoint": TRAIN, "kwargs": QUICK, "resources": FIVE_MIN}
        sweep = launch(api, name="killed", job=spec, grid={"lr": [0.01, 0.1], "seed": [1, 2, 3]})
        wait_for(started.exists, 30, "the dispatcher's sbatch to start")
        assert service.process is not None
        service.process.kill()
        assert ledger_states(service.database) == {"queued+claimed": 6}  # stored whole, caught in sbatch
        api = service.start("second.log")
        done = finished(api, sweep["id"], timeout=300)
        assert done["counts"] == {"succeeded": 6}, done["trials"]
        jobs = [api.job(trial["job_id"]) for trial in done["trials"]]
        for job in jobs:
            assert submissions(job["folder"]) == [job["external_id"]]  # submitted once
            assert api.states(job["id"]).count("submitted") == 1
            assert job["state"] in TERMINAL_STATE_NAMES

        def accounted() -> list[str]:
            return sorted(row["id"] for row in sacct_jobs(since, tmp_path / "data"))

        wait_for(lambda: len(accounted()) >= 6, 60, "the trials in SLURM's accounting")
        assert accounted() == sorted(job["external_id"] for job in jobs)  # one SLURM job each, no orphan
        assert len({job["external_id"].split("_")[0] for job in jobs}) == 1  # the killed sbatch's array
    finally:
        service.cleanup()
