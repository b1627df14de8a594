"""The batch script the service writes for a job with a spare node, on the real cluster with n3
(deploy/slurm/up.sh --nodes 3): the running side is exec'ed in the batch step, its callable (a stand-in
for the supervisor, spare_supervisor.py) starts srun steps through TORCHYARD_SRUN, and when a node that
is not the batch host is marked down mid-step the allocation goes on with the spare (issue 44)."""

from __future__ import annotations

import functools
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from service.backends import submitit_adapter as adapter
from service.backends.slurm_recovery import StagedPickle
from service.backends.slurm_request import request_for, sbatch_parameters
from tests.integration.slurm.spare_supervisor import supervise
from tests.support import ROOT, wait_for
from worker.spec import RunSpec

pytestmark = pytest.mark.slurm


def _spec(folder: Path) -> RunSpec:
    return RunSpec.model_validate({
        "job_id": 1, "name": "spare", "entrypoint": "worker.tasks.faults:hostnames", "folder": str(folder),
        "resources": {"nodes": 2, "spare_nodes": 1, "tasks_per_node": 1, "timeout_min": 5},
    })  # fmt: skip


def _submit(spec: RunSpec, folder: Path) -> str:
    """sbatch the service's script for `spec`, then stage the stand-in's pickle under the id SLURM gave
    (the running side waits up to 60 s for it)."""
    srun = shutil.which("srun")
    assert srun is not None
    script = request_for([spec], sbatch_parameters(spec.resources, None), folder=folder, workdir=folder,
                         python=sys.executable, srun=srun).materialize()  # fmt: skip
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script
    (folder / "batch.sh").write_text(script)
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(["sbatch", "--parsable", str(folder / "batch.sh")], env=environment,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    slurm_id = done.stdout.strip().split(";")[0]
    staged = StagedPickle(folder, "0" * 32, 1)
    staged.write(adapter.pickled_call(functools.partial(supervise, str(folder)), 5))
    staged.adopt(slurm_id)
    return slurm_id


def _result(folder: Path, slurm_id: str) -> dict[str, Any]:
    path = folder / f"{slurm_id}_0_result.pkl"
    wait_for(path.exists, 180, "the stand-in supervisor's result")
    with path.open("rb") as handle:
        outcome, value = pickle.load(handle)
    assert outcome == "success", value
    assert isinstance(value, dict)
    return value


def test_a_lost_node_leaves_the_allocation_and_the_spare_takes_its_place(
    three_nodes: list[str], tmp_path: Path
) -> None:
    folder = tmp_path / "job" / "submitit"
    folder.mkdir(parents=True)
    slurm_id = _submit(_spec(folder), folder)
    wait_for(lambda: (folder / "up-n1").exists() and (folder / "up-n2").exists(), 120, "step 1 on n1, n2")

    down_at = time.time()
    subprocess.run(["scontrol", "update", "nodename=n2", "state=down", "reason=test_spares_slurm"],
                   check=True, timeout=30)  # fmt: skip
    result = _result(folder, slurm_id)
    seen = {key: value for key, value in result.items() if key != "step_env"}
    print(f"\nstand-in supervisor: {seen}")

    assert result["batch_host"] == "n1" and result["allocation"] == three_nodes
    assert result["first"] == ["n1", "n2"]
    assert result["step1_rc"] != 0 and "Node failure on n2" in result["step1_stderr"]
    assert result["step1_ended"] - down_at < 10  # srun returns within a second or so (docs/slurm.md)
    # n2 came back idle at once (ReturnToService=2), but it is no longer this allocation's.
    assert result["usable_after"] == ["n1", "n3"]
    assert (result["step2_rc"], result["step2_hosts"]) == (0, ["n1", "n3"])
    # The batch step is rank 0 of the whole allocation in SLURM's eyes: the supervisor must not take
    # these for its ranks' variables (each srun step sets its own).
    assert result["step_env"]["SLURM_JOB_NODELIST"] == "n[1-3]" and result["step_env"]["SLURM_PROCID"] == "0"

    def final() -> str | None:
        done = subprocess.run(["sacct", "-n", "-P", "-X", "-j", slurm_id, "-o", "State,NodeList"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
        rows = done.stdout.split()
        return rows[-1] if rows and rows[-1].startswith("COMPLETED") else None

    # Same SLURM job throughout: a RESIZING row, then COMPLETED on the nodes left.
    assert wait_for(final, 60, f"job {slurm_id} COMPLETED in sacct") == "COMPLETED|n[1,3]"
