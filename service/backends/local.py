"""The local backend: submitit's local controller, one per job on this machine, started by us.

Each job's controller runs in a session of its own, so that a Ctrl-C on the service leaves jobs
running and cancel can stop the controller and every rank together (one process group). It starts
as the job's Unix account, in the job's folder, with the built environment of service.backends.job_env.
After a service restart there is no Popen handle: the controller's PID (the external id) and the
job folder's files are all there is, and they are enough.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from service.accounts import Account
from service.backends.base import SUBMITTED_SUFFIX, BackendStatus, SubmitOutcome
from service.backends.job_env import JobEnvironment
from service.backends.job_folder_files import remove_from, rename_in, write_new_file
from service.backends.submitit_adapter import CONTROLLER_MARK as _CONTROLLER_MARK
from service.backends.submitit_adapter import local_controller, pickled_call
from service.states import JobState
from worker.launch import RankLauncher
from worker.spec import JobFiles, RunSpec

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 3.0
HOST = socket.gethostname()  # where every local job runs
RESULT_CHECK_S = 0.02


class LocalBackend:
    name = "local"
    max_nodes = 1  # this machine
    runs_arrays = False  # no scheduler to throttle a sweep: the dispatcher does

    def __init__(self, environment: JobEnvironment, poll_interval_s: float = 0.25) -> None:
        # Checking a local job is a waitpid and a file look, so it can be done often.
        self.poll_interval_s = poll_interval_s
        self._environment = environment
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()
        self._wakeup: Callable[[], None] = lambda: None

    # ---------------------------------------------------------------- protocol

    def validate(self, spec: RunSpec) -> None:
        """Nothing to ask: the one limit, a single node, is `max_nodes`, checked at admission."""

    def validate_is_quick(self, spec: RunSpec) -> bool:
        return True

    def array_size(self) -> int | None:
        return None  # no arrays: the dispatcher throttles a sweep (runs_arrays)

    def submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        return [self._submit_one(spec) for spec in specs]

    def poll(self, external_ids: Sequence[str]) -> dict[str, BackendStatus]:
        return {external_id: self._status(external_id) for external_id in external_ids}

    def recover(self, folders: Sequence[Path]) -> dict[Path, str | None]:
        # A controller started by a dispatcher that died before submitit renamed its pickle waits
        # for it in vain and ends on its own, before any user code: submitting again is safe.
        return {folder: None for folder in folders}

    def disowned(self, named: Mapping[Path, str]) -> set[Path]:
        """A named PID that is a live controller of another folder (its command line names it)."""
        found = set()
        for folder, external_id in named.items():
            try:
                argv = Path(f"/proc/{external_id}/cmdline").read_bytes().split(b"\0")
            except (OSError, ValueError):  # gone: nothing to tell, and nothing to harm
                continue
            ours = str(JobFiles(folder).submitit).encode()
            if any(_CONTROLLER_MARK in arg for arg in argv) and ours not in argv:
                found.add(folder)
        return found

    def cancel(self, external_ids: Sequence[str]) -> None:
        for external_id in external_ids:
            self._signal_group(external_id, signal.SIGINT)
            timer = threading.Timer(CANCEL_GRACE_S, self._signal_group, (external_id, signal.SIGKILL))
            timer.daemon = True
            timer.start()

    def log_path(self, folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
        return folder / "submitit" / f"{external_id}_{rank}_log.{stream}"

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        self._wakeup = callback

    def close(self) -> None:
        with self._lock:
            self._processes.clear()

    # ---------------------------------------------------------------- submission

    def _submit_one(self, spec: RunSpec) -> SubmitOutcome:
        try:
            process = self._start(spec)
        except Exception as error:  # the folder or the OS said no: this job only
            log.warning("local submission of job %s failed: %s", spec.job_id, error)
            return SubmitOutcome(job_id=spec.job_id, error=f"local submission failed: {error}")
        external_id = str(process.pid)
        with self._lock:
            self._processes[external_id] = process
        threading.Thread(
            target=self._watch, args=(process, spec.files.result), name=f"watch-{external_id}", daemon=True
        ).start()
        return SubmitOutcome(job_id=spec.job_id, external_id=external_id)

    def _start(self, spec: RunSpec) -> subprocess.Popen[bytes]:
        """Start the job's controller (submitit's, which starts and watches the ranks) and give it
        the pickle it waits for, `<its PID>_submitted.pkl`: staged first, then renamed, both through
        a no-link handle on the job's submitit folder (service.backends.job_folder_files).

        The controller, and through it every rank, starts as the job's account, in the job's folder,
        with the built environment and nothing of the service's, in a session of its own: what
        submitit's own start_controller cannot do (it passes the service's whole environment on)."""
        account = Account.of_job(spec.run_as)
        environment = self._environment.with_python(spec.python)
        folder = spec.files.submitit.absolute()
        timeout_min = int(spec.resources.timeout_min)
        staged = f".pickle-{uuid.uuid4().hex}.tmp"
        write_new_file(folder, staged, pickled_call(RankLauncher(spec.model_dump_json()), timeout_min))
        controller = local_controller(
            environment.python,
            str(folder),
            tasks=spec.resources.tasks_per_node,
            gpus=spec.resources.gpus_per_node,
            timeout_min=timeout_min,
        )
        try:
            process = subprocess.Popen(
                [*account.command_prefix(), *controller.argv],
                env={**environment.variables(account), **controller.variables},
                cwd=spec.files.folder,
                start_new_session=True,
            )
        except BaseException:
            remove_from(folder, staged)
            raise
        rename_in(folder, staged, f"{process.pid}{SUBMITTED_SUFFIX}")
        return process

    def _watch(self, process: subprocess.Popen[bytes], result: Path) -> None:
        """Wake the reconciler when rank 0's result appears and when the controller ends.

        The result comes first, while the ranks tear down (torch's exit alone takes a while): that
        is when the job is done for its user. A stat every RESULT_CHECK_S costs next to nothing.
        """
        seen_result = False
        while True:
            try:
                process.wait(timeout=RESULT_CHECK_S)
            except subprocess.TimeoutExpired:
                if not seen_result and result.exists():
                    seen_result = True
                    self._wakeup()
                continue
            self._wakeup()
            return

    # ---------------------------------------------------------------- status and signals

    def _status(self, external_id: str) -> BackendStatus:
        with self._lock:
            process = self._processes.get(external_id)
        if process is not None:
            code = process.poll()
            if code is None:
                return BackendStatus(JobState.running, nodes=HOST)
            with self._lock:
                self._processes.pop(external_id, None)
            return _ended(code)
        if _controller_alive(external_id):
            return BackendStatus(JobState.running, reason="re-attached after restart", nodes=HOST)
        return _ended(None)

    def _signal_group(self, external_id: str, signum: int) -> None:
        with self._lock:
            process = self._processes.get(external_id)
        alive = process.poll() is None if process is not None else _controller_alive(external_id)
        if not alive:
            return
        try:
            os.killpg(int(external_id), signum)
        except (ProcessLookupError, PermissionError, ValueError) as error:
            log.info("could not signal local job %s: %s", external_id, error)


def _ended(exit_code: int | None) -> BackendStatus:
    """The controller is gone; the job folder's files say how it went (the reconciler reads them)."""
    return BackendStatus(JobState.succeeded, reason="process ended", exit_code=exit_code)


def _controller_alive(external_id: str) -> bool:
    """True when this PID is still a live submitit controller (not a zombie, not a reused PID)."""
    proc = Path("/proc") / external_id
    try:
        stat = (proc / "stat").read_text()
        cmdline = (proc / "cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError, NotADirectoryError):
        return False
    state = stat.rsplit(")", 1)[-1].split()[0]
    return state not in ("Z", "X") and _CONTROLLER_MARK in cmdline
