"""The local backend writes a job's pickle only through a no-link handle on its submitit folder: a job
of the same account can swap that folder for a link to any folder while the service (root) writes."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

from service.backends.job_env import JobEnvironment
from service.backends.local import LocalBackend
from tests.support import wait_for
from worker.spec import JobFiles, RunSpec


def test_a_submitit_folder_swapped_for_a_link_gets_no_pickle(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = RunSpec(
        job_id=1, name="x", entrypoint="worker.tasks.seed:ddp_parameters", folder=str(tmp_path / "1")
    )
    Path(spec.folder).mkdir()
    spec.files.submitit.symlink_to(elsewhere, target_is_directory=True)
    backend = LocalBackend(JobEnvironment.build(tmp_path / "data"))

    outcome = backend.submit([spec])[0]

    assert not outcome.accepted
    assert "Not a directory" in str(outcome.error)
    assert list(elsewhere.iterdir()) == []


def test_an_adopted_pid_of_another_folder_s_controller_is_disowned(tmp_path: Path) -> None:
    def controller(folder: Path) -> subprocess.Popen[bytes]:  # the command line a controller has
        code = "import time; time.sleep(30)"
        return subprocess.Popen([sys.executable, "-c", code, "-m", "submitit.local._local", str(folder)])

    mine, theirs = JobFiles(tmp_path / "1"), JobFiles(tmp_path / "2")
    processes = [controller(mine.submitit), controller(theirs.submitit)]
    try:
        for process, files in zip(processes, (mine, theirs), strict=True):
            started = functools.partial(_names, Path(f"/proc/{process.pid}/cmdline"), files.submitit)
            wait_for(started, 10, "the controller")  # until it has exec'd, /proc shows the parent
        backend = LocalBackend(JobEnvironment.build(tmp_path / "data"))
        named = {mine.folder: str(processes[0].pid), tmp_path / "3": str(processes[1].pid)}

        assert backend.disowned({**named, tmp_path / "4": "999999999"}) == {tmp_path / "3"}
    finally:
        for process in processes:
            process.kill()
            process.wait()


def _names(cmdline: Path, folder: Path) -> bool:
    return str(folder).encode() in cmdline.read_bytes()
