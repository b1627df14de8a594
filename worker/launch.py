"""Supervisor: the callable the service hands to submitit, which calls it once per allocation; and
RankLauncher, which runs one rank of a run the supervisor started (worker.rank_main).

Importing this module must stay cheap and torch-free: the service imports it to pickle supervisors,
and never imports torch. Everything heavy (torch, the runner, submitit's helpers) is imported
inside the methods, after the rank's environment (spec.env, OMP_NUM_THREADS) is in place.

Construct either from the attempt's RunSpec (or its JSON): `Supervisor(spec)`. Only the JSON text is
kept, so the pickle does not depend on pydantic's or torch's internals.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import traceback
from typing import Any

from worker.distributed import RANK_ENV_NAMES, derive_rank_env, guess_rank, scheduler_job_id
from worker.files import write_error
from worker.spec import CHECKPOINT_DIR_ENV, JOB_DIR_ENV, RunSpec

log = logging.getLogger("worker")


class _Requeueable:
    """What both callables submitit runs share: the RunSpec's JSON (so the pickle depends on neither
    pydantic's nor torch's internals), the requeue count, and submitit's Checkpointable protocol."""

    requeues: int = 0  # a class default too, so a launcher pickled before the field existed loads

    def __init__(self, spec: RunSpec | str, *, requeues: int = 0) -> None:
        self.spec_json = spec if isinstance(spec, str) else spec.model_dump_json()
        self.requeues = requeues

    @property
    def spec(self) -> RunSpec:
        return RunSpec.model_validate_json(self.spec_json)

    def __call__(self) -> Any:
        raise NotImplementedError

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """Called by submitit when the job is preempted or times out: what to requeue. The same
        callable for the same attempt, told to resume from the newest whole checkpoint in the job
        folder (the entrypoint saved it; nothing is saved here, inside a signal handler)."""
        from submitit.helpers import DelayedSubmission

        spec = self.spec
        latest = spec.files.latest_checkpoint()
        if latest is not None:
            spec = spec.model_copy(update={"resume_from": str(latest)})
        log.info("requeueing job %s attempt %d, resume_from=%s", spec.job_id, spec.attempt, spec.resume_from)
        return DelayedSubmission(type(self)(spec, requeues=self.requeues + 1))

    def __repr__(self) -> str:
        spec = self.spec
        return (f"{type(self).__name__}(job_id={spec.job_id}, attempt={spec.attempt}, "
                f"requeues={self.requeues}, name={spec.name!r})")


class RankLauncher(_Requeueable):
    """Runs one rank of one job attempt, in a process the job's supervisor started: worker.rank_main is
    its one user in the product. It is no longer what the service hands submitit (Supervisor is), so
    submitit never calls its checkpoint(); the requeue count comes from the supervisor (REQUEUES_ENV),
    unless `requeues` says otherwise (a rank run directly, as tests and benchmarks do).
    """

    def __call__(self) -> Any:
        """Run this rank; returns the entrypoint's value (rank 0's is also written to result.json)."""
        spec = self.spec
        try:
            job_id = scheduler_job_id(os.environ, fallback=spec.job_id)
            env = derive_rank_env(os.environ, job_id=job_id, gpus_per_node=spec.resources.gpus_per_node,
                                  requeues=self.requeues or None)  # 0: the supervisor's count
        except Exception:
            # Without a rank we cannot do anything sensible; leave the reason where the service looks.
            rank = guess_rank(os.environ)
            setup_logging(rank)
            log.exception("cannot derive this rank's environment")
            write_error(spec.files.error(rank), spec.attempt, traceback.format_exc())
            raise
        setup_logging(env.rank)
        # A first line on the rank's own stdout for every run of it: the logs of a rank restarted in
        # place go on in the same file, and this line tells where each run begins.
        sys.stdout.write(f"torchyard: job {spec.job_id} attempt {spec.attempt} run {env.run}: "
                         f"global_rank={env.rank} world_size={env.world_size} local_rank={env.local_rank} "
                         f"host={socket.gethostname()}\n")
        sys.stdout.flush()
        log.info("job %s attempt %d (scheduler job %s, restart %d): %s rank %d/%d (local %d/%d, node %d) "
                 "device=%s master=%s", spec.job_id, spec.attempt, env.job_id, env.restart, env.source,
                 env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank, env.device,
                 env.master_addr)
        apply_env(spec)
        watch_stacks(spec, env.rank, has_gpu=env.gpu is not None)
        take_cancel_signal()

        try:
            from worker.runner import run_rank  # torch arrives here, after apply_env
        except ImportError as error:  # an interpreter without torch: every rank says so, at once
            text = f"the job's interpreter {sys.executable} cannot run ranks: {error}\n"
            write_error(spec.files.error(env.rank), spec.attempt, text + traceback.format_exc())
            raise
        return run_rank(spec, env)


class Supervisor(_Requeueable):
    """What submitit runs once per allocation (the local controller's one task, SLURM's batch script):
    the job's supervisor, which starts the ranks and restarts them in place (worker.supervisor).

    Torch-free, as RankLauncher is; only the RunSpec's JSON is kept. `requeues` counts the times
    checkpoint() handed this attempt back (submitit's requeue on preemption or time-out)."""

    def __call__(self) -> None:
        from worker.supervisor import run_supervised

        spec = self.spec
        setup_logging(-1)
        take_cancel_signal()
        run_supervised(spec, requeues=self.requeues)


class _RankFilter(logging.Filter):
    """Drops submitit's own records (it has its handlers) so they are not printed twice."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("submitit")


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """One stderr handler on the root logger whose lines start with `[rank N]` (`[supervisor]` for a
    negative rank); idempotent."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_torchyard_rank", None) is not None:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    who = "supervisor" if rank < 0 else f"rank {rank}"
    handler.setFormatter(logging.Formatter(f"[{who}] %(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_RankFilter())
    handler._torchyard_rank = rank  # type: ignore[attr-defined]
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)


def apply_env(spec: RunSpec) -> None:
    """The rank's place and environment, before torch is imported, so OMP_*/NCCL_* settings take effect.

    The rank works in its job's folder (TORCHYARD_JOB_DIR), or in its code snapshot (unpacked there
    by the service, first on sys.path) when it has one, whatever folder the scheduler started it in;
    its temporary files go to the folder's tmp/ (TMPDIR), its checkpoints to TORCHYARD_CHECKPOINT_DIR.
    spec.env comes on top: the service allowed each key. The rank variables are ours to set (script
    mode) and are refused here. OMP_NUM_THREADS defaults to the cpus the job asked for per rank, as
    torchrun does, so ranks do not fight over cores.
    """
    files = spec.files
    files.tmp.mkdir(mode=0o700, parents=True, exist_ok=True)  # the folder too, outside the service
    if spec.code is not None:  # the job's snapshot: its files resolve from there, its modules first
        os.chdir(files.code)
        if str(files.code) not in sys.path:  # once, though a forked rank's warm parent did this too
            sys.path.insert(0, str(files.code))
    else:
        os.chdir(files.folder)
    os.environ["TMPDIR"] = str(files.tmp)
    for name, value in spec.env.items():
        if name in RANK_ENV_NAMES:
            log.warning("ignoring %s from the job's env: the launcher sets the rank variables", name)
            continue
        os.environ[name] = value
    os.environ[JOB_DIR_ENV] = str(files.folder)
    os.environ[CHECKPOINT_DIR_ENV] = str(files.checkpoints)
    os.environ.setdefault("OMP_NUM_THREADS", str(spec.resources.cpus_per_task))
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def watch_stacks(spec: RunSpec, rank: int, *, has_gpu: bool) -> None:
    """Stacks on SIGURG and the activity file (worker.stacks), for a function and a script alike,
    before the entrypoint runs; an NCCL rank's flight recorder on, where the job did not set it."""
    from worker.stacks import dump_flight_recorder_on_capture, flight_recorder_env, install_stack_dumps

    install_stack_dumps(spec.files, rank, spec.attempt, socket.gethostname())
    if has_gpu:  # NCCL is its backend (worker.distributed.choose_backend)
        flight_recorder_env(spec.files, os.environ)
        dump_flight_recorder_on_capture(spec.files, rank)


def take_cancel_signal() -> None:
    """Let SIGINT reach this rank as a cancel (KeyboardInterrupt), whatever the process it came from did.

    A cancel reaches a rank as SIGINT: the local backend's, to the job's process group. A process
    started with SIGINT ignored passes that on to its children, and Python leaves an ignored SIGINT
    ignored; a shell starts every background job so (`torchyard serve &`, and CI scripts). The ranks
    then ignored every cancel until SIGKILL came.
    """
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)

