"""The contract with submitit that service/backends/submitit_adapter.py relies on, checked against the
installed submitit: a new submitit version that renames or changes any of it fails here first, not on
a cluster. Real processes run submitit's running side on files our code wrote."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import operator
import os
import pickle
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import tomllib
from submitit.core.utils import DelayedSubmission, JobPaths
from submitit.local import local as submitit_local
from submitit.local.local import LocalJobEnvironment
from submitit.slurm.slurm import SlurmJobEnvironment

from service.backends import submitit_adapter as adapter
from service.backends.slurm_recovery import StagedPickle
from service.backends.slurm_submit import link_array_folders
from service.jobfs import SUBMITTED_SUFFIX
from tests.support import wait_for

REPO = Path(__file__).resolve().parents[3]
ADD = functools.partial(operator.add, 2, 3)  # importable wherever the running side runs


def test_the_installed_submitit_is_the_pinned_one_everywhere() -> None:
    assert importlib.metadata.version("submitit") == adapter.PINNED_VERSION
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"submitit=={adapter.PINNED_VERSION}" in project["dependencies"]
    job_python = (REPO / "deploy" / "job-python.sh").read_text()  # the ranks' own submitit
    assert f"SUBMITIT_VERSION={adapter.PINNED_VERSION}\n" in job_python


def test_the_running_side_s_modules_are_where_we_start_them() -> None:
    for module in (adapter.RUNTIME_MODULE, adapter.LOCAL_CONTROLLER_MODULE):
        assert importlib.util.find_spec(module) is not None, module
    assert adapter.LOCAL_CONTROLLER_MODULE.encode() == adapter.CONTROLLER_MARK


def test_the_public_names_keep_their_shape() -> None:
    assert list(inspect.signature(DelayedSubmission.set_timeout).parameters) == [
        "self",
        "timeout_min",
        "max_num_timeout",
    ]
    delayed = pickle.loads(adapter.pickled_call(ADD, 7))
    assert isinstance(delayed, DelayedSubmission) and delayed.result() == 5
    folder = Path("/jobs/1/submitit")
    assert JobPaths(folder, "7_1").submitted_pickle == folder / f"7_1{SUBMITTED_SUFFIX}"
    assert JobPaths(folder, "7_1", 2).stdout == folder / "7_1_2_log.out"  # the backends' log_path
    assert JobPaths(folder, "7_1", 2).stderr == folder / "7_1_2_log.err"
    assert JobPaths(folder, "7_1").result_pickle == folder / "7_1_0_result.pkl"


def test_the_executor_variable_and_the_checkpoint_signal() -> None:
    assert SlurmJobEnvironment.name() == "slurm" and LocalJobEnvironment.name() == "local"
    if "SUBMITIT_PREEMPT_SIGNAL" in os.environ:
        pytest.skip("this process's environment changes submitit's signal")
    assert SlurmJobEnvironment.USR_SIG == adapter.CHECKPOINT_SIGNAL


def test_the_local_controller_gets_the_variables_submitit_s_own_would(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    started: list[dict[str, Any]] = []
    monkeypatch.setattr(submitit_local.subprocess, "Popen", lambda *args, **kwargs: started.append(kwargs))
    monkeypatch.setattr(submitit_local, "os", SimpleNamespace(environ={}))  # its env: only its own
    command = adapter.runtime_command(sys.executable, str(tmp_path))
    submitit_local.start_controller(tmp_path, command, tasks_per_node=2, cuda_devices="0,1", timeout_min=3)

    ours = adapter.local_controller(sys.executable, str(tmp_path), tasks=2, gpus=2, timeout_min=3)

    assert ours.variables == started[0]["env"]
    assert ours.argv == [sys.executable, "-m", adapter.LOCAL_CONTROLLER_MODULE, str(tmp_path)]


@pytest.mark.parametrize("array", [False, True])
def test_the_running_side_finds_the_pickle_where_we_put_it(tmp_path: Path, array: bool) -> None:
    """What srun runs in a task, on the folder our script names, with the variables SLURM sets: it
    loads the pickle we staged and adopted, runs it, and writes the result beside it (for an array
    element, in its own job folder, through the array folder's `<index>` link)."""
    job = tmp_path / "jobs" / "4" / "submitit"
    job.mkdir(parents=True)
    slurm = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    if array:
        root = tmp_path / "slurm-arrays" / "a"
        root.mkdir(parents=True)
        link_array_folders(root, [tmp_path / "elsewhere", job])  # this job is element 1
        folder, external_id = root / "%a", "7_1"
        slurm |= {"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "1"}
    else:
        folder, external_id = job, "9"
    staged = StagedPickle(job, "0" * 32, 1)
    staged.write(adapter.pickled_call(ADD, 5))
    staged.adopt(external_id)
    environment = {"PATH": os.defpath, "PYTHONPATH": os.pathsep.join(sys.path), **slurm}
    environment[adapter.EXECUTOR_VARIABLE] = "slurm"  # as the script exports it

    done = subprocess.run(
        shlex.split(adapter.runtime_command(sys.executable, str(folder))),
        env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    with (job / f"{external_id}_0_result.pkl").open("rb") as handle:
        assert pickle.load(handle) == ("success", 5)


def test_the_local_controller_finds_the_pickle_where_we_put_it(tmp_path: Path) -> None:
    folder = tmp_path / "submitit"
    folder.mkdir()
    controller = adapter.local_controller(sys.executable, str(folder), tasks=1, gpus=0, timeout_min=1)
    environment = {"PATH": os.defpath, "PYTHONPATH": os.pathsep.join(sys.path), **controller.variables}
    process = subprocess.Popen(controller.argv, env=environment, cwd=tmp_path)
    try:
        (folder / f"{process.pid}{SUBMITTED_SUFFIX}").write_bytes(adapter.pickled_call(ADD, 1))
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    result = folder / f"{process.pid}_0_result.pkl"
    wait_for(result.exists, 5, "the rank's result")
    with result.open("rb") as handle:
        assert pickle.load(handle) == ("success", 5)
    for stream in ("out", "err"):  # where the backends' log_path looks
        assert (folder / f"{process.pid}_0_log.{stream}").exists()
