"""Which hosts of the job's SLURM allocation can still run ranks: for the supervisor, before each step.

The supervisor runs once per allocation, in the batch script, and starts the ranks with one `srun` step
per run. When a step ends because a node was lost, the next step must leave that node out. Two facts
from the test cluster (docs/slurm.md, "Lost nodes") decide how this is asked:

- With `--no-kill`, a node that goes down is removed from the allocation at once (the job's NodeList
  shrinks, the job id stays), and an srun naming it fails ("Requested node configuration is not
  available"). `SLURM_JOB_NODELIST` in the batch script's environment does not change: it still names
  every node the allocation started with. So the allocation's nodes NOW come from `squeue`.
- With `ReturnToService=2`, a node marked down whose slurmd still answers is back to `idle` within
  about 50 ms: `sinfo` alone would call a lost node usable again, although it is no longer this job's.
  sinfo still tells the nodes that are in the allocation but not responding (`mixed*`), drained or
  draining, which a new step should avoid too.

- A node that is really lost (its slurmd gone) stays in the allocation and `mixed` in sinfo until
  slurmctld declares it down, 85 s later here (SlurmdTimeout=60): until then only the supervisor knows
  (a rank vanished there), and it must leave that node out itself; these calls cannot tell.

So `usable_hosts` makes two bounded calls, `squeue -h --jobs=<id> -o %N` and
`sinfo -h -N --nodes=<hosts> -o "%N %T"`, and keeps the hosts both agree on, in the order given.
The programs are the ones beside `srun`: the service exports srun's absolute path as TORCHYARD_SRUN
(the job's own PATH is the job's), and sinfo and squeue are installed in the same folder as srun.
No torch and no service import here.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from worker.hostlist import expand_hostlist
from worker.spec import SRUN_ENV

# What a supervisor's step needs (docs/slurm.md, "Lost nodes"): --kill-on-bad-exit ends the whole step
# within 0.25 s when a node is marked down (srun --no-kill would let the others run to their end);
# --overlap lets the next step start although slurmctld may keep a step of a really lost node RUNNING
# (without it: "step creation temporarily disabled ... Requested nodes are busy", forever).
SRUN_STEP_FLAGS = ("--kill-on-bad-exit=1", "--overlap", "--unbuffered")
QUERY_TIMEOUT_S = 10.0
MAX_OUTPUT_CHARS = 256 * 1024  # a few thousand nodes' lines; more is not SLURM talking
# The base states (sinfo %T) in which a node runs job steps; any other (down, drained, draining, fail,
# failing, maint, reboot, future, unknown, ...) is left out.
USABLE_STATES = frozenset({"idle", "mixed", "allocated", "completing", "planned"})
# State suffixes: "*" not responding, "~" powered off, "#" powering up, "%" powering down, "!" power
# down pending, "@" reboot pending, "^" rebooting, "$" maintenance reservation. "-" (planned by the
# backfill) and "+" are harmless.
_BAD_SUFFIXES = frozenset("*~#%!@^$")
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_JOB_ID = re.compile(r"^[0-9]+$")


class SlurmQueryError(RuntimeError):
    """squeue or sinfo failed, timed out or could not be started; the message says which and why."""


def allocation_hosts(environ: Mapping[str, str]) -> list[str]:
    """Every host the allocation started with (SLURM_JOB_NODELIST, expanded), in SLURM's order; the
    first is the batch host. [] outside an allocation. ValueError for an expression that is not one."""
    expression = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or ""
    return list(dict.fromkeys(expand_hostlist(expression)))


def scheduler_program(name: str, environ: Mapping[str, str]) -> Path:
    """SLURM's program `name` (sinfo, squeue, scontrol) from the folder of TORCHYARD_SRUN.
    ValueError when that variable is missing or not an absolute path."""
    srun = environ.get(SRUN_ENV, "")
    if not srun or not os.path.isabs(srun):
        raise ValueError(f"{SRUN_ENV} must be srun's absolute path, not {srun!r}")
    return Path(srun).parent / name


def node_states(text: str) -> dict[str, str]:
    """Lines of `sinfo -h -N -o "%N %T"` -> {host: state as printed}, e.g. {"n2": "down*"}. A node in
    several partitions is printed once per partition: its first line counts."""
    states: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and _HOST.match(fields[0]):
            states.setdefault(fields[0], fields[1].lower())
    return states


def is_usable(state: str) -> bool:
    """Whether a node in this sinfo state (`%T`, suffixes included) can take a new job step."""
    base = state.rstrip("*~#%!@^$-+")
    suffixes = set(state[len(base) :])
    return base in USABLE_STATES and not suffixes & _BAD_SUFFIXES


def select_usable(hosts: Sequence[str], allocation: str, sinfo: str) -> list[str]:
    """The hosts (order kept) that are still in the allocation (`squeue -o %N` output: one hostlist
    expression) and in a usable state (`sinfo -h -N -o "%N %T"` output). Pure: tested on captures."""
    expression = allocation.strip().splitlines()[0].strip() if allocation.strip() else ""
    current = set(expand_hostlist(expression))
    states = node_states(sinfo)
    return [host for host in hosts if host in current and is_usable(states.get(host, "unknown"))]


def usable_hosts(
    hosts: Sequence[str], job_id: str, environ: Mapping[str, str], *, timeout_s: float = QUERY_TIMEOUT_S
) -> list[str]:
    """The hosts, among `hosts`, that a new step of job `job_id` (SLURM_JOB_ID) can run on now: still in
    the allocation and not down, drained, draining, failing or unresponsive. Two calls (see the module's
    docstring), each at most `timeout_s`. ValueError for a bad host or job id; SlurmQueryError when a
    call fails."""
    if not _JOB_ID.match(job_id):
        raise ValueError(f"not a SLURM job id: {job_id!r}")
    bad = [host for host in hosts if not _HOST.match(host)]
    if bad:
        raise ValueError(f"not host names: {bad[:5]!r}")
    if not hosts:
        return []
    squeue = [str(scheduler_program("squeue", environ)), "-h", f"--jobs={job_id}", "-o", "%N"]
    sinfo = [str(scheduler_program("sinfo", environ)), "-h", "-N", f"--nodes={','.join(hosts)}",
             "-o", "%N %T"]  # fmt: skip
    return select_usable(hosts, _run(squeue, timeout_s), _run(sinfo, timeout_s))


def _run(argv: list[str], timeout_s: float) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout_s,
                              stdin=subprocess.DEVNULL)  # fmt: skip
    except subprocess.TimeoutExpired as error:
        raise SlurmQueryError(f"{Path(argv[0]).name} took more than {timeout_s:.0f} s") from error
    except OSError as error:
        raise SlurmQueryError(f"cannot run {argv[0]}: {error}") from error
    if done.returncode != 0:
        said = done.stderr.strip()[-500:]
        raise SlurmQueryError(f"{Path(argv[0]).name} failed (exit status {done.returncode}): {said}")
    return done.stdout[:MAX_OUTPUT_CHARS]
