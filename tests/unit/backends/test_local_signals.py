"""The local backend signals only process groups that are its jobs'.

A cancel's signals go to a job's process group, named by its controller's PID. A PID outlives nothing:
once the controller is gone it may be any process's, and the service runs as root. Twice, while the
browser tests cancelled their jobs, processes of other people on the same machine died of signals they
should never have had. So a PID is signalled only while it is known to be the job's controller: one this
backend started and has not reaped (an unreaped child keeps its PID), or, after a restart, the session
leader running a controller of a job folder under this service's jobs root.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import service.backends.local as local
from service.backends import make_backends
from service.backends.base import Backend
from service.backends.local import signal_group
from service.config import Settings
from service.jobfs import jobs_root
from service.states import JobState
from tests.support import wait_for

GRACE_S = 0.3  # the cancel's SIGKILL comes this long after its SIGINT (3 s in the service)


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setattr(local, "CANCEL_GRACE_S", GRACE_S)
    return Settings(data_dir=tmp_path / "data", backends=["local"], job_accounts="service")


@pytest.fixture
def backend(settings: Settings) -> Iterator[Backend]:
    """The local backend as the service builds it."""
    built = make_backends(settings)["local"]
    yield built
    built.close()


def controller_of(submitit_folder: Path) -> subprocess.Popen[bytes]:
    """A process that is, to anyone reading /proc, a job's controller: a session leader whose command
    line is `python -m submitit.local._local <folder>`. It sleeps, and dies of SIGINT as Python does."""
    code = "import time; time.sleep(60)"
    argv = [sys.executable, "-c", code, "-m", "submitit.local._local", str(submitit_folder)]
    process = subprocess.Popen(argv, start_new_session=True)
    cmdline = Path(f"/proc/{process.pid}/cmdline")
    wait_for(lambda: str(submitit_folder).encode() in cmdline.read_bytes(), 10, "the controller's exec")
    return process


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        process.kill()
        process.wait()


def test_a_pid_that_names_another_services_controller_is_never_signalled(
    backend: Backend, tmp_path: Path, started: list[subprocess.Popen[bytes]]
) -> None:
    """What a stale id (a controller gone, its PID reused) names may be another service's job: the same
    software, a session leader with a controller's command line, in a folder that is not this one's."""
    theirs = controller_of(tmp_path / "elsewhere" / "jobs" / "7" / "submitit")
    started.append(theirs)

    status = backend.poll([str(theirs.pid)])[str(theirs.pid)]
    assert status.state is JobState.succeeded  # ended: not this service's job, so not re-attached
    backend.cancel([str(theirs.pid)])
    time.sleep(GRACE_S + 0.5)  # past the SIGKILL as well

    assert theirs.poll() is None, f"another service's job was stopped (exit status {theirs.returncode})"


def test_after_a_restart_a_controller_of_this_services_jobs_is_still_stopped(
    backend: Backend, settings: Settings, started: list[subprocess.Popen[bytes]]
) -> None:
    """The restart case the PID check must keep: no Popen handle, only the PID in the ledger."""
    ours = controller_of(jobs_root(settings) / "5" / "submitit")
    started.append(ours)

    assert backend.poll([str(ours.pid)])[str(ours.pid)].state is JobState.running
    backend.cancel([str(ours.pid)])

    assert ours.wait(timeout=GRACE_S + 10) != 0  # stopped by the cancel, not run out


def test_a_job_started_here_is_stopped_through_its_handle_even_after_close(
    backend: Backend, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The SIGKILL after a cancel is bound to the controller the cancel meant, when the cancel is made:
    it reaches a controller that ignored the SIGINT although the backend was closed meanwhile (as the
    tests' teardown cancels, then stops the service), and the bare id is never looked up again."""
    from worker.spec import RunSpec

    def start(self: object, spec: RunSpec) -> subprocess.Popen[bytes]:  # a controller deaf to SIGINT
        code = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
        return subprocess.Popen(
            [sys.executable, "-c", code, "-m", "submitit.local._local", str(spec.files.submitit)],
            start_new_session=True,
        )

    monkeypatch.setattr(local.LocalBackend, "_start", start)
    folder = tmp_path / "x" / "1"
    spec = RunSpec(job_id=1, name="x", entrypoint="worker.tasks.faults:sleep", folder=str(folder))
    external_id = backend.submit([spec])[0].external_id
    assert external_id is not None
    time.sleep(0.5)  # past its signal() call

    backend.cancel([external_id])
    backend.close()

    pid = int(external_id)
    wait_for(lambda: not _running(pid), GRACE_S + 10, "the SIGKILL after the cancel")


@pytest.mark.parametrize("which", ["0", "1", "own group", "own process"])
def test_groups_that_name_everyone_or_the_service_itself_are_never_signalled(
    which: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """killpg(0) is the caller's own group, killpg(1) is kill(-1): every process there is."""
    pgid = {"0": 0, "1": 1, "own group": os.getpgrp(), "own process": os.getpid()}[which]
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "killpg", lambda pgid, signum: sent.append((pgid, signum)))

    signal_group(pgid, signal.SIGINT)

    assert sent == []


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")
