"""The local backend: submitit's local controller, one per job on this machine, started by us.

Each job's controller runs in a session of its own, so that a Ctrl-C on the service leaves jobs
running and cancel can stop the controller and every rank together (one process group). It starts
as the job's Unix account, in the job's folder, with the built environment of service.backends.job_env.
After a service restart there is no Popen handle: the controller's PID (the external id) and the
job folder's files are all there is, and they are enough.

A PID names a job's group only while the job's controller holds it: once the controller is gone the
number is free, and the service (root, on a shared machine) must never signal whoever has it next. A
controller this backend started keeps its PID until this backend reaps it, so every reap and every
signal to such a group happen under one lock; a controller known only by its PID (after a restart) is
signalled only while it is a session leader running a controller of a job folder under this
service's jobs root, looked at just before the signal. Cancel's later SIGKILL is bound, when the cancel
is made, to the controller it means, never to the bare id looked up again after the grace.
"""

from __future__ import annotations

import functools
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
from service.backends.base import BackendStatus, StackRequest, SubmitOutcome
from service.backends.job_env import JobEnvironment
from service.backends.submitit_adapter import CONTROLLER_MARK, local_controller, pickled_call
from service.jobfs import SUBMITTED_SUFFIX, log_file, remove_from, rename_in, write_new_file
from service.programs import run_bounded
from service.states import JobState
from worker.launch import Supervisor
from worker.spec import JobFiles, RunSpec, ascii_int

log = logging.getLogger(__name__)

CANCEL_GRACE_S = 3.0
SIGNALLER_TIMEOUT_S = 10.0
# What the signaller runs, as the job's account, in the job's own interpreter (-I -S: no site, no
# environment, nothing of the job's packages): one killpg of the group it is given, and nothing else.
_KILLPG = "import os, signal, sys; os.killpg(int(sys.argv[1]), signal.SIGURG)"
HOST = socket.gethostname()  # where every local job runs


class LocalBackend:
    name = "local"
    max_nodes = 1  # this machine
    runs_arrays = False  # no scheduler to throttle a sweep: the dispatcher does

    def __init__(
        self, environment: JobEnvironment, poll_interval_s: float = 0.25, *, jobs_root: Path | None = None
    ) -> None:
        """`jobs_root`: where this service's job folders are, which tells its controllers from another
        service's after a restart; without it, only controllers this backend started are its own."""
        # Checking a local job is a waitpid and a file look, so it can be done often.
        self.poll_interval_s = poll_interval_s
        self._environment = environment
        self._jobs_root = jobs_root
        self._processes: dict[str, subprocess.Popen[bytes]] = {}
        # Guards _processes, and is held around every reap of a controller this backend started and
        # every signal to its group: an unreaped child keeps its PID, so the group is the job's.
        self._lock = threading.Lock()

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
            if any(CONTROLLER_MARK in arg for arg in argv) and ours not in argv:
                found.add(folder)
        return found

    def cancel(self, external_ids: Sequence[str]) -> None:
        """SIGINT to each job's process group now, SIGKILL to what is left of it CANCEL_GRACE_S later.

        Both go through the handle taken now: the Popen of a controller this backend started, which
        the SIGKILL reaches even if the backend is closed meanwhile, or else the PID, looked at again
        before each signal. The bare id looked up again after the grace could name anyone: by then
        the controller may be gone, and once it is reaped its PID is free for the next process."""
        for external_id in external_ids:
            with self._lock:
                process = self._processes.get(external_id)
            if process is not None:
                stop = functools.partial(self._signal_started, process)
            elif (pid := ascii_int(external_id)) is not None:
                stop = functools.partial(self._signal_adopted, pid)
            else:
                log.warning("not a local job's id, nothing signalled: %r", external_id)
                continue
            stop(signal.SIGINT)
            timer = threading.Timer(CANCEL_GRACE_S, stop, (signal.SIGKILL,))
            timer.daemon = True
            timer.start()

    def signal_stacks(self, job: StackRequest) -> bool:
        """SIGURG to the job's process group (its controller and every rank: each rank dumps its stacks,
        the controller ignores it), sent by a child that runs as the job's account: whatever the group
        holds by then, the signal reaches only what that account may signal. The group is checked as
        cancel checks it, and a controller this backend started is not reaped until the child is done."""
        try:
            account = Account.of_job(job.run_as)
        except KeyError:  # the account is gone from this host: nobody to signal as
            return False
        with self._lock:
            process = self._processes.get(job.external_id)
            if process is not None:
                return process.poll() is None and self._signal_as(account, job, process.pid)
        pid = ascii_int(job.external_id)
        if pid is None or not self._is_our_controller(pid):
            return False
        return self._signal_as(account, job, pid)

    def _signal_as(self, account: Account, job: StackRequest, pgid: int) -> bool:
        if pgid <= 1 or pgid in (os.getpid(), os.getpgrp()):
            log.error("refused to signal process group %d: it is not a local job's", pgid)
            return False
        if account.is_current:  # the service's own account: a child would be the service again
            try:
                os.killpg(pgid, signal.SIGURG)
            except (ProcessLookupError, PermissionError) as error:
                log.info("could not signal local job %s: %s", pgid, error)
                return False
            return True
        python = self._environment.with_python(job.python).python
        argv = [*account.command_prefix(), python, "-I", "-S", "-c", _KILLPG, str(pgid)]
        try:
            done = run_bounded(argv, timeout_s=SIGNALLER_TIMEOUT_S, most_bytes=4096, env={}, cwd="/")
        except Exception as error:  # no setpriv, an interpreter that hangs or floods: this job only
            log.warning("could not signal local job %s as %s: %s", pgid, account.name, error)
            return False
        if done.returncode != 0:
            log.info("signalling local job %s as %s failed: %s", pgid, account.name, done.stderr[-300:])
        return done.returncode == 0

    def log_path(self, folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
        return log_file(folder, external_id, rank, stream)

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        """Nothing to tell: the reconciler looks for a job's result itself, between its polls."""

    def close(self) -> None:
        """Forget the handles; a cancel's pending SIGKILL keeps its own, and each reaper thread reaps
        its controller when it ends."""
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
        reaper = threading.Thread(target=self._reap_when_ended, args=(process,), name=f"reap-{process.pid}")
        reaper.daemon = True
        reaper.start()
        return SubmitOutcome(job_id=spec.job_id, external_id=external_id)

    def _reap_when_ended(self, process: subprocess.Popen[bytes]) -> None:
        """Wait for the controller to end, then reap it under the lock: a job the reconciler stops
        polling (ended by a rank's error, cancelled) would otherwise stay a zombie for good.

        The wait leaves the child unreaped (WNOWAIT), so its PID stays its own until the reap, which
        happens under the lock as every signal to its group does; Popen keeps the exit status for
        the next poll to report."""
        try:
            os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:  # reaped already, by a poll
            return
        with self._lock:
            process.poll()

    def _start(self, spec: RunSpec) -> subprocess.Popen[bytes]:
        """Start the job's controller (submitit's, which starts and watches the ranks) and give it
        the pickle it waits for, `<its PID>_submitted.pkl`: staged first, then renamed, both through
        a no-link handle on the job's submitit folder (service.jobfs).

        The controller, and through it every rank, starts as the job's account, in the job's folder,
        with the built environment and nothing of the service's, in a session of its own: what
        submitit's own start_controller cannot do (it passes the service's whole environment on)."""
        account = Account.of_job(spec.run_as)
        environment = self._environment.with_python(spec.python)
        folder = spec.files.submitit.absolute()
        timeout_min = int(spec.resources.timeout_min)
        staged = f".pickle-{uuid.uuid4().hex}.tmp"
        write_new_file(folder, staged, pickled_call(Supervisor(spec.model_dump_json()), timeout_min))
        controller = local_controller(
            environment.python,
            str(folder),
            tasks=1,  # the job's supervisor, which starts the ranks (worker.supervisor)
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

    # ---------------------------------------------------------------- status and signals

    def _status(self, external_id: str) -> BackendStatus:
        with self._lock:
            process = self._processes.get(external_id)
            code = None if process is None else process.poll()
            if process is not None and code is not None:
                self._processes.pop(external_id, None)
        if process is not None:
            return BackendStatus(JobState.running, nodes=HOST) if code is None else _ended(code)
        pid = ascii_int(external_id)
        if pid is not None and self._is_our_controller(pid):
            return BackendStatus(JobState.running, reason="re-attached after restart", nodes=HOST)
        return _ended(None)

    def _signal_started(self, process: subprocess.Popen[bytes], signum: int) -> None:
        """Signal the group of a controller this backend started, unless it has been reaped: until then
        its PID is still its own (a zombie's too), and only this backend reaps it, under this lock."""
        with self._lock:
            if process.returncode is None:
                signal_group(process.pid, signum)

    def _signal_adopted(self, pid: int, signum: int) -> None:
        """Signal the group of a controller known only by its PID, if that PID is still one of ours.

        The check and the signal are microseconds apart; the PID would have to be freed and handed out
        again, through every PID of the machine, in between."""
        if self._is_our_controller(pid):
            signal_group(pid, signum)
        else:
            log.info("local job %s is gone; its PID is not signalled", pid)

    def _is_our_controller(self, pid: int) -> bool:
        """The process at `pid` leads its own session (as each controller does, so the group is the
        job's alone) and runs submitit's controller on a job folder under this service's jobs root.

        Anything else that has the PID now is not the job's, even a controller of another service:
        the same command line on another folder. Without a jobs root there is no telling."""
        if self._jobs_root is None:
            return False
        proc = Path("/proc") / str(pid)
        try:  # stat's second field is the command's name, which may hold anything, ")" included
            fields = (proc / "stat").read_bytes().rsplit(b")", 1)[1].split()
            argv = (proc / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            state, group, session = fields[0], fields[2], fields[3]
        except (OSError, IndexError):  # gone, or not readable
            return False
        leads_its_session = group == session == str(pid).encode()
        if state in (b"Z", b"X") or not leads_its_session or argv[-3:-1] != [b"-m", CONTROLLER_MARK]:
            return False
        folder = Path(os.fsdecode(argv[-1]))
        return (
            folder.name == "submitit"
            and ascii_int(folder.parent.name) is not None
            and folder.parent.parent == self._jobs_root
        )


def signal_group(pgid: int, signum: int) -> None:
    """killpg, refused for the groups that are not one job's: 0 is the caller's own group, 1 would be
    kill(-1), every process there is, and the service's own group or PID is never a job's."""
    if pgid <= 1 or pgid in (os.getpid(), os.getpgrp()):
        log.error("refused to signal process group %d: it is not a local job's", pgid)
        return
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError) as error:
        log.info("could not signal local job %s: %s", pgid, error)


def _ended(exit_code: int | None) -> BackendStatus:
    """The controller is gone; the job folder's files say how it went (the reconciler reads them)."""
    return BackendStatus(JobState.succeeded, reason="process ended", exit_code=exit_code)
