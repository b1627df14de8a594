"""The local backend writes a job's pickle only through a no-link handle on its submitit folder: a job
of the same account can swap that folder for a link to any folder while the service (root) writes."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from service.accounts import Account
from service.backends.job_env import JobEnvironment
from service.backends.local import LocalBackend
from service.jobfs import log_file, make_job_folder
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


def test_log_paths_come_from_the_one_builder(tmp_path: Path) -> None:
    backend = LocalBackend(JobEnvironment.build(tmp_path / "data"))
    assert backend.log_path(tmp_path, "4242", 1, "err") == tmp_path / "submitit" / "4242_1_log.err"
    assert backend.log_path(tmp_path, "4242", 1, "err") == log_file(tmp_path, "4242", 1, "err")


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


@pytest.mark.skipif(os.geteuid() != 0, reason="switching a job to another account needs root")
def test_a_setpriv_planted_in_the_interpreters_folder_never_runs(tmp_path: Path) -> None:
    """The job's PATH starts with its interpreter's folder, which its user may own: the `setpriv` that
    starts the job as its account is the service's own, by its absolute path, never one found there."""
    env = tmp_path / "env" / "bin"  # a project environment's folder, the user's to write
    env.mkdir(parents=True)
    (env / "python").symlink_to(sys.executable)
    ran_as_root = tmp_path / "planted-setpriv-ran"
    planted = env / "setpriv"
    planted.write_text(f'#!/bin/sh\ntouch {ran_as_root}\nexec {shutil.which("setpriv")} "$@"\n')
    planted.chmod(0o755)
    spec = RunSpec(
        job_id=1, name="x", entrypoint="worker.tasks.seed:ddp_parameters", folder=str(tmp_path / "1"),
        run_as="nobody", python=str(env / "python"),
    )  # fmt: skip
    make_job_folder(spec.files, Account.named("nobody"), None)
    environment = JobEnvironment.build(tmp_path / "data")
    assert environment.with_python(spec.python).path[0] == str(env)  # first on the job's PATH

    backend = LocalBackend(environment)
    outcome = backend.submit([spec])[0]
    try:
        assert outcome.accepted, outcome.error
        wait_for(lambda: not _controller_running(outcome.external_id), 30, "the controller to end")
    finally:
        # A controller still running is stopped as the service stops it, through the backend's own
        # handle. Never `kill -9 -<pid>`: Debian 12's kill program reads -12345 as -1, every process.
        if outcome.external_id is not None:
            backend.cancel([outcome.external_id])
    assert not ran_as_root.exists()


def _controller_running(pid: str | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists() and b"Z" not in _state(pid)


def _state(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[-1].split()[:1][0]
    except (OSError, IndexError):
        return b"Z"
