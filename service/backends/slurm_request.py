"""What one sbatch asks for, as plain data, and the pure function that writes its script.

Modelled on TorchX's `SlurmBatchRequest.materialize()`: `SbatchRequest` holds every choice (resources,
folders, interpreter, array and throttle), and `materialize()` turns it into the batch script with no
file, process or clock involved, so a test, or a dry run, reads the exact script without submitting it.
The script runs submitit's running side ONCE, in the batch step itself (`exec`, no srun): the pickled
callable is the job's supervisor, which starts the ranks with one `srun` step per run and, when a node
is lost, runs a new step on the nodes left and a spare, in the same allocation (issue 44). Hence
`--no-kill` (a lost node shrinks the allocation instead of ending it), `nodes + spare_nodes` nodes,
the checkpoint signal as `B:USR2@N` (to the batch step only: `exec` makes the supervisor that process;
it forwards the signal to its srun, which hands it to every rank), srun's absolute path exported
as TORCHYARD_SRUN (the job's PATH is the job's), and the ranks' log templates for its steps.
docs/slurm.md, "Lost nodes", has the facts.
Writing the script ourselves leaves us no private submitit name to call.

Every value that reaches the script is checked first: the resources against patterns in worker.spec
(only the ALLOWED_SBATCH_OPTIONS become options of their own), the job name cut to safe characters,
the folders free of control characters; and each value is shell-quoted on its line.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.backends.submitit_adapter import (
    CHECKPOINT_SIGNAL,
    EXECUTOR_VARIABLE,
    log_templates,
    runtime_command,
)
from worker.spec import RANK_ERROR_ENV, RANK_OUTPUT_ENV, SRUN_ENV, Resources, RunSpec

# The only Resources fields that reach sbatch as options of their own (the allow-list): each value is
# checked against a pattern in worker.spec, and goes into the script as one shell-quoted #SBATCH line.
ALLOWED_SBATCH_OPTIONS = ("partition", "account", "qos", "constraint")
# The wckey submitit has always given our jobs: kept, so that accounting by wckey goes on as it was.
WCKEY = "submitit"
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9_.\-]+")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

Options = tuple[tuple[str, Any], ...]  # sbatch options, sorted by name (underscores for dashes)


def sbatch_parameters(resources: Resources, default_partition: str | None) -> dict[str, Any]:
    """The sbatch options of Resources, by option name with underscores (`ntasks_per_node`). `nodes`
    counts the spare nodes too: SLURM allocates them (and `--test-only` checks them) like the others."""
    params: dict[str, Any] = {
        "nodes": resources.nodes + resources.spare_nodes,  # the spares wait idle in the allocation
        "ntasks_per_node": resources.tasks_per_node,
        "cpus_per_task": resources.cpus_per_task,
        "time": int(resources.timeout_min),
    }
    if resources.gpus_per_node:
        params["gpus_per_node"] = resources.gpus_per_node
    if resources.mem_gb is not None:
        params["mem"] = f"{math.ceil(resources.mem_gb * 1024)}M"
    for option in ALLOWED_SBATCH_OPTIONS:
        value = getattr(resources, option)
        if option == "partition":
            value = value or default_partition
        if value:
            params[option] = value
    return params


def group_key(params: dict[str, Any]) -> Options:
    """Parameters as a hashable, ordered key: jobs with equal keys can share one sbatch."""
    return tuple(sorted(params.items()))


def check_argv(params: dict[str, Any]) -> list[str]:
    """sbatch's arguments (after the program) for `--test-only` with these parameters: the scheduler's
    verdict without a job. No shell."""
    flags = [f"--{key.replace('_', '-')}={value}" for key, value in sorted(params.items())]
    return ["--test-only", "--output=/dev/null", *flags, "--wrap=true"]


def warning_signal_delay_s(timeout_min: int) -> int:
    """How long before the time limit SLURM sends the checkpoint signal (submitit's default is 90 s).

    For a short limit 90 s would arrive at once, and submitit would take it for a time-out and
    requeue the job over and over; a quarter of the limit, at most 90 s, leaves it time to run.
    """
    return max(5, min(90, timeout_min * 60 // 4))


def share_throttle(max_parallel: int | None, arrays: int) -> list[int | None]:
    """The `%N` of each of the `arrays` arrays one group (a sweep) needs past MaxArraySize: together
    `max_parallel` (None: no throttle), each at least 1. The claim hands over no more of a sweep than
    max_parallel arrays hold (service.loops.sweep_claims), so there are never more arrays than that:
    ValueError if there are, before anything is submitted."""
    if max_parallel is None:
        return [None] * arrays
    if arrays > max_parallel:
        raise ValueError(
            f"{arrays} arrays cannot share a max_parallel of {max_parallel}: the claim hands over at most "
            "max_parallel arrays of a sweep"
        )
    base, extra = divmod(max_parallel, arrays)
    return [base + (1 if index < extra else 0) for index in range(arrays)]


def job_name(specs: Sequence[RunSpec]) -> str:
    """One sbatch job name; a newline in it would end the #SBATCH line, so only safe characters."""
    names = {spec.name for spec in specs}
    name = names.pop() if len(names) == 1 else "torchyard"
    return _UNSAFE_NAME.sub("_", name)[:128] or "torchyard"


def check_folder(folder: Path) -> None:
    """Paths go into the script shell-quoted, which does not make a newline safe: refuse those (each
    job on its own, before its group's script is written)."""
    _check_line("job folder", str(folder))


def _check_line(what: str, value: str) -> None:
    if _CONTROL.search(value):
        raise ValueError(f"{what} has a control character: {value!r}")


@dataclass(frozen=True)
class SbatchRequest:
    """One sbatch: a job, or an array of `array_size` elements at most `array_parallelism` at once.

    `folder` is the job's submitit folder, where the running side finds its pickle and writes its
    logs: the job's own, or for an array `<array folder>/%a`, each `<index>` there a link to that
    element's own folder. `workdir` is where the job starts (`--chdir`)."""

    options: Options  # from sbatch_parameters
    job_name: str
    folder: str
    workdir: str
    python: str
    srun: str  # srun's absolute path, from the service's own PATH: the script's PATH is the job's
    signal_delay_s: int
    array_size: int | None = None
    array_parallelism: int | None = None

    def materialize(self) -> str:
        """The batch script: `#SBATCH` lines sorted by option (`--no-kill` last), then the running side
        `exec`ed in the batch step, its output in rank 0's log files (the supervisor's srun names each
        rank's own). ValueError for a value with a control character: quoting does not keep a newline
        from starting a line of its own."""
        stdout, stderr = log_templates(self.folder, array=self.array_size is not None)
        options: dict[str, Any] = {key.replace("_", "-"): value for key, value in self.options}
        options.update(
            {
                "job-name": self.job_name,
                "chdir": self.workdir,
                # B: the batch step only, which `exec` makes the supervisor; without it SLURM signals
                # every step but not the batch step.
                "signal": f"B:{CHECKPOINT_SIGNAL}@{self.signal_delay_s}",
                "output": stdout.replace("%t", "0"),
                "error": stderr.replace("%t", "0"),
                "open-mode": "append",  # a requeued job adds to its logs
                "wckey": WCKEY,
            }
        )
        if self.array_size is not None:
            at_once = min(self.array_size, self.array_parallelism or self.array_size)
            options["array"] = f"0-{self.array_size - 1}%{at_once}"
        for key, value in options.items():  # checked before: the script's last word on it
            _check_line(f"--{key}", str(value))
        _check_line("the interpreter", self.python)
        _check_line("srun", self.srun)
        lines = ["#!/bin/bash", "", "# Parameters"]
        lines += [f"#SBATCH --{key}={shlex.quote(str(options[key]))}" for key in sorted(options)]
        # A lost node that is not the batch host leaves the allocation, which goes on without it.
        lines += ["#SBATCH --no-kill"]
        lines += [
            "",
            "# command",
            f"export {EXECUTOR_VARIABLE}=slurm",
            f"export {SRUN_ENV}={shlex.quote(self.srun)}",
            f"export {RANK_OUTPUT_ENV}={shlex.quote(stdout)}",
            f"export {RANK_ERROR_ENV}={shlex.quote(stderr)}",
            f"exec {runtime_command(self.python, self.folder)}",
            "",
        ]
        return "\n".join(lines)


def request_for(
    specs: Sequence[RunSpec],
    params: dict[str, Any],
    *,
    folder: Path,
    workdir: Path,
    python: str,
    srun: str,
    parallelism: int | None = None,
) -> SbatchRequest:
    """The request for jobs that share `params` (an array when there are several); `parallelism`:
    a sweep's `%N`, None for independent jobs (all at once)."""
    return SbatchRequest(
        options=group_key(params),
        job_name=job_name(specs),
        folder=str(folder),
        workdir=str(workdir),
        python=python,
        signal_delay_s=warning_signal_delay_s(int(params["time"])),
        array_size=len(specs) if len(specs) > 1 else None,
        array_parallelism=parallelism,
        srun=srun,
    )
