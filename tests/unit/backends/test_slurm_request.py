"""SbatchRequest.materialize(): the batch script from plain data, with no file, process or clock, so it
is read here as a dry run would read it; and that script run by bash as SLURM's batch step would run
it, with a stand-in for the supervisor (the pickled callable)."""

from __future__ import annotations

import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from service.backends import submitit_adapter as adapter
from service.backends.slurm_recovery import StagedPickle
from service.backends.slurm_request import SbatchRequest, check_argv, request_for, sbatch_parameters
from tests.unit.backends.test_slurm_submit import make

PYTHON = "/opt/job python/bin/python"  # a space: the command must quote it


def test_one_job_s_script(tmp_path: Path) -> None:
    spec = make(tmp_path, 1, nodes=2, tasks_per_node=2, constraint="a100|h100", mem_gb=1.5)
    folder = spec.files.submitit
    request = request_for([spec], sbatch_parameters(spec.resources, "debug"), folder=folder,
                          workdir=folder, python=PYTHON, srun="/usr/bin/srun")  # fmt: skip

    assert request.materialize() == "\n".join(
        [
            "#!/bin/bash",
            "",
            "# Parameters",
            f"#SBATCH --chdir={folder}",
            "#SBATCH --constraint='a100|h100'",
            "#SBATCH --cpus-per-task=1",
            f"#SBATCH --error={folder}/%j_0_log.err",
            "#SBATCH --job-name=job-1",
            "#SBATCH --mem=1536M",
            "#SBATCH --nodes=2",
            "#SBATCH --ntasks-per-node=2",
            "#SBATCH --open-mode=append",
            f"#SBATCH --output={folder}/%j_0_log.out",
            "#SBATCH --partition=debug",
            "#SBATCH --signal=B:USR2@75",
            "#SBATCH --time=5",
            "#SBATCH --wckey=submitit",
            "#SBATCH --no-kill",
            "",
            "# command",
            "export SUBMITIT_EXECUTOR=slurm",
            "export TORCHYARD_SRUN=/usr/bin/srun",
            f"export TORCHYARD_RANK_OUTPUT={folder}/%j_%t_log.out",
            f"export TORCHYARD_RANK_ERROR={folder}/%j_%t_log.err",
            f"exec {shlex.quote(PYTHON)} -u -m submitit.core._submit {folder}",
            "",
        ]
    )


def test_spare_nodes_are_part_of_the_allocation(tmp_path: Path) -> None:
    spec = make(tmp_path, 1, nodes=2, tasks_per_node=2, spare_nodes=1)
    params = sbatch_parameters(spec.resources, None)
    assert params["nodes"] == 3 and params["ntasks_per_node"] == 2
    assert "--nodes=3" in check_argv(params)  # sbatch --test-only checks the spares too
    script = request_for([spec], params, folder=spec.files.submitit, workdir=spec.files.submitit,
                         python=PYTHON, srun="/usr/bin/srun").materialize()  # fmt: skip
    assert "#SBATCH --nodes=3\n" in script and "#SBATCH --no-kill\n" in script


def test_an_array_s_script_names_each_element_s_files_by_index(tmp_path: Path) -> None:
    specs = [make(tmp_path, n) for n in (1, 2, 3)]
    root = tmp_path / "slurm-arrays" / "a"
    request = request_for(specs, sbatch_parameters(specs[0].resources, None), folder=root / "%a",
                          workdir=root, python=PYTHON, srun="srun", parallelism=2)  # fmt: skip
    script = request.materialize()

    assert request.array_size == 3 and request.array_parallelism == 2
    assert "#SBATCH --array=0-2%2" in script
    assert f"#SBATCH --output={root}/%a/%A_%a_0_log.out" in script
    assert f"export TORCHYARD_RANK_ERROR={root}/%a/%A_%a_%t_log.err\n" in script  # each rank's, by index
    assert f"#SBATCH --chdir={root}\n" in script
    assert script.rstrip().endswith(f"-m submitit.core._submit {root}/%a")
    assert "#SBATCH --job-name=torchyard" in script  # several names: none of them


def test_an_unthrottled_array_runs_every_element_at_once() -> None:
    request = SbatchRequest(options=(("time", 5),), job_name="x", folder="/a/%a", workdir="/a",
                            python="python", srun="srun", signal_delay_s=75, array_size=4)  # fmt: skip
    assert "#SBATCH --array=0-3%4" in request.materialize()


@pytest.mark.parametrize("change", [{"options": (("time", 5), ("qos", "a\nrm -rf /"))},
                                    {"folder": "/f\nrm -rf /"}, {"python": "python\rx"},
                                    {"srun": "/usr/bin/srun\nx"}])  # fmt: skip
def test_no_value_can_start_a_line_of_its_own(change: dict[str, Any]) -> None:
    # Shell quoting does not make a newline safe: the values are checked before (worker.spec's
    # patterns, check_folder), and the script refuses any that would still carry one.
    fields: dict[str, Any] = {"options": (("time", 5),), "job_name": "x", "folder": "/f", "workdir": "/f",
                              "python": "python", "srun": "srun", "signal_delay_s": 75}  # fmt: skip
    with pytest.raises(ValueError, match="control character"):
        SbatchRequest(**{**fields, **change}).materialize()


def stand_in_supervisor() -> dict[str, Any]:
    """What the lead's supervisor will be: the pickled callable, run once in the batch step. This one
    runs the srun the script exported, and says which process it is."""
    srun = os.environ["TORCHYARD_SRUN"]
    done = subprocess.run([srun, "--nodes=2", "hostname"], capture_output=True, text=True, check=True)
    return {"pid": os.getpid(), "srun_said": done.stdout.strip(), "procid": os.environ.get("SLURM_PROCID"),
            "rank_output": os.environ.get("TORCHYARD_RANK_OUTPUT")}  # fmt: skip


def test_the_batch_step_execs_the_supervisor_which_finds_srun(tmp_path: Path) -> None:
    """bash runs the script as slurmd would run the batch step (SLURM's variables set, no PATH to srun):
    the running side is exec'ed (same process as the batch shell, so `--signal=B:USR2` reaches it),
    loads the staged pickle, and the callable finds srun through TORCHYARD_SRUN."""
    job = tmp_path / "job" / "submitit"
    job.mkdir(parents=True)
    srun = tmp_path / "slurm bin" / "srun"  # a space: the export must quote it
    srun.parent.mkdir()
    srun.write_text('#!/bin/sh\necho "srun $*"\n')
    srun.chmod(0o755)
    script = request_for([make(tmp_path, 1)], {"nodes": 2, "time": 5}, folder=job, workdir=job,
                         python=sys.executable, srun=str(srun)).materialize()  # fmt: skip
    (tmp_path / "batch.sh").write_text(script)
    staged = StagedPickle(job, "0" * 32, 1)
    staged.write(adapter.pickled_call(stand_in_supervisor, 5))
    staged.adopt("9")
    environment = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(sys.path), "SLURM_JOB_ID": "9",
                   "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                   "SLURM_JOB_NODELIST": "n[1-3]"}  # fmt: skip

    process = subprocess.Popen(["bash", str(tmp_path / "batch.sh")], env=environment, cwd=job,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 0, stderr
    with (job / "9_0_result.pkl").open("rb") as handle:
        outcome, result = pickle.load(handle)
    assert outcome == "success", result
    assert result == {"pid": process.pid, "srun_said": "srun --nodes=2 hostname", "procid": "0",
                      "rank_output": f"{job}/%j_%t_log.out"}  # fmt: skip
