"""submitit, as far as the service leans on it: the one module that imports it, and the one place for
the names of it that are not its public API. They hold for the submitit version pinned in
pyproject.toml (PINNED_VERSION); tests/unit/backends/test_submitit_contract.py fails when an upgrade
changes any of them.

What submitit does for us: it pickles the callable (`DelayedSubmission`, public) and runs it where the
job runs. On a SLURM node, srun starts `python -u -m submitit.core._submit <folder>` in every task: it
waits for `<folder>/<job id>_submitted.pkl`, runs it, writes `<job id>_<rank>_result.pkl`, and on the
checkpoint signal checkpoints and requeues. On this machine, `python -m submitit.local._local <folder>`
is the controller that starts the ranks of a local job the same way.

What we do ourselves, because submitit's submitting side cannot do it our way: the sbatch script
(service.backends.slurm_request writes it from plain data), sbatch itself (as the job's account,
through the backend's counted runner), status queries, and starting the local controller as the job's
account, in a session of its own, with the built environment and in the job's folder (submitit's
`start_controller` gives the controller the service's whole environment and can do none of that).
"""

from __future__ import annotations

import pickle
import shlex
from collections.abc import Callable
from dataclasses import dataclass

from submitit.core.utils import DelayedSubmission, JobPaths

PINNED_VERSION = "1.5.4"

# --- Private names: what submitit's submitting side uses to talk to its running side. ---------------
RUNTIME_MODULE = "submitit.core._submit"  # run by srun in each task: loads the pickle, runs it
LOCAL_CONTROLLER_MODULE = "submitit.local._local"  # the local controller: starts and watches the ranks
# A live local controller's command line holds this: how a PID is told to be a controller of ours.
CONTROLLER_MARK = LOCAL_CONTROLLER_MODULE.encode()
# The running side picks its JobEnvironment (paths, rank, requeue) by this variable's value.
EXECUTOR_VARIABLE = "SUBMITIT_EXECUTOR"
# The signal the running side takes as "checkpoint and requeue": JobEnvironment.USR_SIG's default. The
# node's environment is the job's built one, which never sets SUBMITIT_PREEMPT_SIGNAL to change it.
CHECKPOINT_SIGNAL = "USR2"
# ---------------------------------------------------------------------------------------------------

MAX_NUM_TIMEOUT = 3  # submitit's default: how many time-outs requeue a Checkpointable before it fails


def pickled_call(function: Callable[[], object], timeout_min: int) -> bytes:
    """What the running side loads from `<id>_submitted.pkl`: the call, with the time limit it tells
    a time-out from a preemption by. Plain pickle, not submitit's cloudpickle dump: our callables are
    importable classes, and cloudpickle's per-object hooks cost more than the write for hundreds of
    trials."""
    delayed = DelayedSubmission(function)
    delayed.set_timeout(timeout_min, MAX_NUM_TIMEOUT)
    return pickle.dumps(delayed, pickle.HIGHEST_PROTOCOL)


def runtime_command(python: str, folder: str) -> str:
    """The shell command every task runs: the running side, on the job's submitit folder (which may
    hold SLURM's %a: the runtime formats it from SLURM_ARRAY_TASK_ID)."""
    return shlex.join([python, "-u", "-m", RUNTIME_MODULE, folder])


def log_templates(folder: str, array: bool) -> tuple[str, str]:
    """stdout and stderr of every task (`%t`) as the running side names them: `<id>_<rank>_log.out`,
    an array element's id being `<array id>_<index>` (SLURM's %A_%a)."""
    paths = JobPaths(folder)
    out, err = str(paths.stdout), str(paths.stderr)
    return (out.replace("%j", "%A_%a"), err.replace("%j", "%A_%a")) if array else (out, err)


@dataclass(frozen=True)
class LocalController:
    """How one local job's controller starts: its command line and the variables it reads."""

    argv: list[str]
    variables: dict[str, str]


def local_controller(
    python: str, folder: str, *, tasks: int, gpus: int, timeout_min: int, signal_delay_s: int = 30
) -> LocalController:
    """The controller of a local job of `tasks` ranks on `folder`. The variables are the ones
    submitit's own start_controller sets (30 s: its default warning before the time limit); the
    caller adds the job's built environment and starts it as the job's account."""
    command = runtime_command(python, folder)
    variables = {
        "SUBMITIT_LOCAL_NTASKS": str(tasks),
        "SUBMITIT_LOCAL_COMMAND": command,
        "SUBMITIT_LOCAL_TIMEOUT_S": str(60 * timeout_min),
        "SUBMITIT_LOCAL_SIGNAL_DELAY_S": str(signal_delay_s),
        "SUBMITIT_LOCAL_NODEID": "0",
        "SUBMITIT_LOCAL_JOB_NUM_NODES": "1",
        "SUBMITIT_STDERR_TO_STDOUT": "",
        EXECUTOR_VARIABLE: "local",
        "CUDA_VISIBLE_DEVICES": ",".join(str(index) for index in range(gpus)),
        "SUBMITIT_LOCAL_WITH_SHELL": "",
    }
    return LocalController([python, "-m", LOCAL_CONTROLLER_MODULE, folder], variables)
