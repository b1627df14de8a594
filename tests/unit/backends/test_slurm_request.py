"""SbatchRequest.materialize(): the batch script from plain data, with no file, process or clock, so it
is read here as a dry run would read it."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest

from service.backends.slurm_request import SbatchRequest, request_for, sbatch_parameters
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
            "#SBATCH --signal=USR2@75",
            "#SBATCH --time=5",
            "#SBATCH --wckey=submitit",
            "",
            "# command",
            "export SUBMITIT_EXECUTOR=slurm",
            f"/usr/bin/srun --unbuffered --output {folder}/%j_%t_log.out --error {folder}/%j_%t_log.err "
            f"--kill-on-bad-exit=1 {shlex.quote(PYTHON)} -u -m submitit.core._submit {folder}",
            "",
        ]
    )


def test_an_array_s_script_names_each_element_s_files_by_index(tmp_path: Path) -> None:
    specs = [make(tmp_path, n) for n in (1, 2, 3)]
    root = tmp_path / "slurm-arrays" / "a"
    request = request_for(specs, sbatch_parameters(specs[0].resources, None), folder=root / "%a",
                          workdir=root, python=PYTHON, srun="srun", parallelism=2)  # fmt: skip
    script = request.materialize()

    assert request.array_size == 3 and request.array_parallelism == 2
    assert "#SBATCH --array=0-2%2" in script
    assert f"#SBATCH --output={root}/%a/%A_%a_0_log.out" in script
    assert f"#SBATCH --chdir={root}\n" in script
    assert script.rstrip().endswith(f"-m submitit.core._submit {root}/%a")
    assert "#SBATCH --job-name=torchyard" in script  # several names: none of them


def test_an_unthrottled_array_runs_every_element_at_once() -> None:
    request = SbatchRequest(options=(("time", 5),), job_name="x", folder="/a/%a", workdir="/a",
                            python="python", srun="srun", signal_delay_s=75, array_size=4)  # fmt: skip
    assert "#SBATCH --array=0-3%4" in request.materialize()


@pytest.mark.parametrize("change", [{"options": (("time", 5), ("qos", "a\nrm -rf /"))},
                                    {"folder": "/f\nrm -rf /"}, {"python": "python\rx"}])  # fmt: skip
def test_no_value_can_start_a_line_of_its_own(change: dict[str, Any]) -> None:
    # Shell quoting does not make a newline safe: the values are checked before (worker.spec's
    # patterns, check_folder), and the script refuses any that would still carry one.
    fields: dict[str, Any] = {"options": (("time", 5),), "job_name": "x", "folder": "/f", "workdir": "/f",
                              "python": "python", "srun": "srun", "signal_delay_s": 75}  # fmt: skip
    with pytest.raises(ValueError, match="control character"):
        SbatchRequest(**{**fields, **change}).materialize()
