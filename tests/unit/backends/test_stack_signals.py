"""Backend.signal_stacks: SIGURG reaches a job's ranks only, sent as the job's own account.

Local: the job's process group, checked as cancel checks it (a controller of this service's jobs root),
signalled by a child that runs as the job's account, so a group that is no longer the job's (a reused
PID) cannot be reached through it. SLURM: one `scancel --signal=URG -- ID` as the account (no --full:
the batch shell is left alone, the srun step's ranks get it; tests/integration/slurm/test_stacks_slurm.py
checks that on the real cluster).
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.backends import make_backends
from service.backends.base import Backend, StackRequest
from service.config import Settings
from service.jobfs import jobs_root
from tests.support import wait_for
from tests.unit.backends.slurm_fakes import FakeCommands, fail, ok
from tests.unit.backends.test_slurm_poll import backend as slurm_backend

# A controller to anyone reading /proc (a session leader running `-m submitit.local._local <folder>`)
# that dumps its stack into `out` on SIGURG, as a rank does.
DUMPER = (
    "import faulthandler, signal, sys, time; out = open(sys.argv[1], 'a');"
    " faulthandler.register(signal.SIGURG, file=out, all_threads=True);"
    " out.write('ready\\n'); out.flush(); time.sleep(60)"
)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", backends=["local"], job_accounts="service")


@pytest.fixture
def local(settings: Settings) -> Iterator[Backend]:
    built = make_backends(settings)["local"]
    yield built
    built.close()


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def dumper(submitit_folder: Path, out: Path, account: str | None = None) -> subprocess.Popen[bytes]:
    prefix = []
    if account is not None:
        entry = pwd.getpwnam(account)
        prefix = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--"]
    argv = [
        *prefix,
        sys.executable,
        "-c",
        DUMPER,
        str(out),
        "-m",
        "submitit.local._local",
        str(submitit_folder),
    ]
    process = subprocess.Popen(argv, start_new_session=True)
    cmdline = Path(f"/proc/{process.pid}/cmdline")
    wait_for(lambda: str(submitit_folder).encode() in cmdline.read_bytes(), 10, "the controller's exec")
    wait_for(lambda: out.exists() and "ready" in out.read_text(), 10, "the dumper's handler")
    return process


def dumped(out: Path) -> bool:
    return "most recent call first" in out.read_text()


def test_a_controller_of_this_services_jobs_dumps_and_another_services_does_not(
    local: Backend, settings: Settings, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    ours, theirs = tmp_path / "ours.txt", tmp_path / "theirs.txt"
    started.append(mine := dumper(jobs_root(settings) / "5" / "submitit", ours))
    started.append(other := dumper(tmp_path / "elsewhere" / "jobs" / "7" / "submitit", theirs))

    assert local.signal_stacks(StackRequest(str(mine.pid)))
    assert not local.signal_stacks(StackRequest(str(other.pid)))
    assert not local.signal_stacks(StackRequest("1"))  # init's group: never
    assert not local.signal_stacks(StackRequest("not-a-pid"))

    wait_for(lambda: dumped(ours), 10, "the stack dump")
    assert theirs.read_text() == "ready\n" and other.poll() is None and mine.poll() is None


def accounts_problem() -> str | None:
    if os.geteuid() != 0:
        return "signalling as another account needs root"
    for name in ("alice", "bob"):
        try:
            pwd.getpwnam(name)
        except KeyError:
            return f"no Unix account {name} (deploy/slurm/up.sh makes alice and bob)"
    return None


@pytest.mark.skipif(accounts_problem() is not None, reason=str(accounts_problem()))
def test_the_signal_goes_out_as_the_jobs_account_and_reaches_nothing_else(
    local: Backend, settings: Settings, started: list[subprocess.Popen[bytes]]
) -> None:
    """alice's job is signalled by a process of alice's; a group of bob's (a PID reused, say) named as
    alice's job cannot be reached through her capture, though it passes every check of the PID."""
    reachable = Path(tempfile.mkdtemp(prefix="torchyard-stacks-", dir="/var/tmp"))  # pytest's are root's
    try:
        reachable.chmod(0o711)
        alices, bobs = reachable / "alice.txt", reachable / "bob.txt"
        for name, path in (("alice", alices), ("bob", bobs)):
            path.touch()
            os.chown(path, pwd.getpwnam(name).pw_uid, -1)
        started.append(alice := dumper(jobs_root(settings) / "5" / "submitit", alices, "alice"))
        started.append(bob := dumper(jobs_root(settings) / "6" / "submitit", bobs, "bob"))

        assert local.signal_stacks(StackRequest(str(alice.pid), run_as="alice"))
        assert not local.signal_stacks(StackRequest(str(bob.pid), run_as="alice"))

        wait_for(lambda: dumped(alices), 10, "alice's stack dump")
        assert bobs.read_text() == "ready\n" and bob.poll() is None
    finally:
        shutil.rmtree(reachable, ignore_errors=True)


def test_slurm_stacks_are_one_scancel_signal_per_job(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("scancel", ok())
    slurm = slurm_backend(commands, tmp_path)

    assert slurm.signal_stacks(StackRequest("7_1"))
    assert not slurm.signal_stacks(StackRequest("--user=bob"))  # not an id: nothing run

    assert commands.calls == [["/opt/slurm/bin/scancel", "--signal=URG", "--", "7_1"]]


def test_slurm_stacks_of_a_job_that_ended_are_false_not_an_error(
    commands: FakeCommands, tmp_path: Path
) -> None:
    commands.on("scancel", fail("scancel: error: Kill job error on job id 5: Invalid job id specified\n"))
    assert not slurm_backend(commands, tmp_path).signal_stacks(StackRequest("5"))
