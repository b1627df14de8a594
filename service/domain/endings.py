"""How an attempt ended, in the words retry policies use, from the scheduler's word and the job folder.

The kinds (service.states.EndingKind):
- failure: the job's own exception (a traceback on a rank that is not about a lost peer), or an end
  without a result that nothing else explains;
- node_failure: the scheduler says a node failed, or a rank vanished: the ranks that wrote an error
  all lost a peer, and the ranks that wrote none are the ones that were lost;
- timeout: the time limit (or a deadline);
- oom: the scheduler's OUT_OF_MEMORY, or every rank killed (exit 137) without a word;
- cancel: cancelled, by the user or an operator;
- hang: the watchdog found the attempt stalled and its spec says `on_stall: "fail"` (service.loops.watch).
- pruned: a sweep's early stopping stopped the trial, which ends `cancelled` (service.loops.sweep_pruning
  says why it is no state of its own).
- preemption: preempted and not requeued (SLURM cancelled it, PreemptMode=CANCEL). A preempted
  job that SLURM requeues is no ending: it comes back as a new attempt (service.states `requeued`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from service.backends.base import Backend, BackendStatus
from service.domain import restarts
from service.jobfs import RankError, log_tail, rank_errors, read_result
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.states import EndingKind, JobState
from worker.hostlist import expand_hostlist
from worker.spec import LOST_PEER, JobFiles

# Reasons other modules recognise a job's ending by (service.domain.pipeline_state reads them back).
CANCELLED_BY_USER = "cancelled by user"  # the reason of every job a user's cancel ends
DEPENDENCY = "dependency job "  # how a job cancelled by a dependency that cannot be met says why
PRUNED = "pruned at rung "  # how a sweep's trial stopped early says why (service.domain.sweep_pruning)

SIGKILL_EXIT = 137  # 128 + 9: the kernel's OOM killer, or `kill -9`


@dataclass(frozen=True)
class Ending:
    state: JobState  # the job's final state, unless a retry follows
    kind: EndingKind | None  # None for a success
    reason: str
    result: Any = None


STACKS_TOLD: frozenset[EndingKind | None] = frozenset({"node_failure", "timeout"})
# A rank's own error that is a collective giving up on its peers (gloo's words): the stacks say why.
COLLECTIVE_TIMEOUT = re.compile(
    r"timed out waiting \d+ ?ms for (recv|send)|collective operation timeout", re.IGNORECASE
)


def with_stacks(ending: Ending, summary: str | None) -> Ending:
    """`ending` with the attempt's last stacks summary (which rank was where before the ranks went
    away) when it is a lost peer, a collective that timed out (a rank's own error saying so), or a job out
    of time, and one was captured."""
    told = ending.kind in STACKS_TOLD or COLLECTIVE_TIMEOUT.search(ending.reason or "") is not None
    if summary is None or not told:
        return ending
    return Ending(ending.state, ending.kind, f"{ending.reason}\nbefore the end: {summary}", ending.result)


def from_rank_errors(job: Job, errors: Sequence[RankError]) -> Ending:
    """The ending told by the ranks' error files (at least one), and by the job's supervisor when it
    gave up restarting the attempt in place."""
    return given_up(job, _from_rank_errors(job, errors))


def given_up(job: Job, ending: Ending) -> Ending:
    """`ending` with why the job's supervisor did not restart the attempt in place, when it gave up
    (service.domain.restarts): the reason names it, and an ending the scheduler and the files leave
    unexplained (a plain failure, no rank's own exception) takes the kind of the loss that was not
    restarted, for `retries` to decide on."""
    gave_up = restarts.of_attempt(job.restart_log, job.run_attempt or job.attempt, restarts.GAVE_UP)
    if not gave_up or ending.state in (JobState.succeeded, JobState.cancelled):
        return ending
    last = gave_up[-1]
    kind = ending.kind
    own_error = " raised:\n" in ending.reason  # from_rank_errors: a rank's own exception
    not_restarted = f"not restarted in place: {last.get('reason')}"
    if kind == "failure" and last.get("cause") in ("node_failure", "hang") and not own_error:
        # the files do not say what was lost; the supervisor saw it (srun's word, a rank's signal)
        reason = f"{restarts.loss(last)}; {not_restarted}\n{ending.reason}"
        return replace(ending, kind=last["cause"], reason=reason)
    return replace(ending, reason=f"{ending.reason}\n({not_restarted})")  # the files named the loss


def _from_rank_errors(job: Job, errors: Sequence[RankError]) -> Ending:
    # A job of one rank has no peer to lose: whatever it raised is its own.
    world_size = job.resources.world_size
    own = [error for error in errors if world_size == 1 or not LOST_PEER.search(error.text)]
    if own:  # a rank raised on its own: the job's failure, whatever its peers said after it
        cause = own[0]
        others = ", ".join(str(error.rank) for error in errors if error is not cause)
        after = f"\n(ranks {others} failed after it)" if others else ""
        reason = f"rank {cause.rank}{_on(job, cause.rank)} raised:\n{cause.text[-4000:]}{after}"
        return Ending(JobState.failed, "failure", reason)
    wrote = {error.rank for error in errors}
    lost = [rank for rank in range(world_size) if rank not in wrote]
    vanished = "; ".join(f"rank {rank}{_on(job, rank)} vanished" for rank in lost) or "a peer vanished"
    first = errors[0]
    reason = f"{vanished} (rank {first.rank}{_on(job, first.rank)} lost it):\n{first.text[-2000:]}"
    return Ending(JobState.failed, "node_failure", reason)


def settle(
    job: Job, files: JobFiles, status: BackendStatus, backend: Backend, *, files_may_follow: bool = False
) -> Ending | None:
    """The ending of an attempt whose processes have ended, from the scheduler's word and the files.

    None while `files_may_follow` (service.loops.files_grace) and neither the folder nor the scheduler
    names the cause: a rank's error file or rank 0's result may not be visible here yet."""
    ending = _settle(job, files, status, backend, files_may_follow)
    return given_up(job, ending) if ending is not None else None


def _settle(
    job: Job, files: JobFiles, status: BackendStatus, backend: Backend, files_may_follow: bool
) -> Ending | None:
    result = read_result(files, job.run_attempt)
    if result is not None and status.state in (JobState.succeeded, JobState.failed):
        return Ending(JobState.succeeded, None, "completed", result["value"])
    if status.lost_batch_host:
        # Before the ranks' errors: those on other nodes may have seen their peers go first, but the
        # cause is the lost batch host, and it decides that no restart in place was possible.
        return Ending(JobState.failed, "node_failure", status.reason or f"{status.lost_batch_host} lost")
    errors = rank_errors(files, job.run_attempt, job.resources.world_size)
    if errors:
        return _from_rank_errors(job, errors)
    if status.kind is not None:  # the scheduler named it: a node failure, OOM, a preemption
        nodes = f" (nodes {job.nodes})" if job.nodes else ""
        return Ending(JobState.failed, status.kind, f"{status.reason or status.kind}{nodes}")
    if status.state is JobState.timeout or _ran_out_of_time(job):
        return Ending(JobState.timeout, "timeout", status.reason or "exceeded its time limit")
    if status.state is JobState.cancelled:
        # A user's cancel: the transitions door names it so, whoever ends the job.
        return Ending(JobState.cancelled, "cancel", status.reason or "cancelled")
    if files_may_follow:
        return None
    code = f" (exit code {status.exit_code})" if status.exit_code is not None else ""
    if status.exit_code == SIGKILL_EXIT:
        reason = f"every rank was killed without a word{code}: out of memory, most likely"
        return Ending(JobState.failed, "oom", reason)
    if status.state is JobState.failed:
        return Ending(JobState.failed, "failure", status.reason or "failed")
    return Ending(JobState.failed, "failure", f"ended without a result{code}{_rank0_stderr(job, backend)}")


def rank_host(job: Job, rank: int) -> str | None:
    """The host of `rank`: as the rank said it (Job.placement), else as the scheduler placed it,
    ranks filling the nodes in order, tasks_per_node each (SLURM's block distribution, which srun uses
    for our jobs; one host for local jobs)."""
    for placed in job.placement or []:
        if placed.get("rank") == rank and isinstance(placed.get("host"), str):
            return str(placed["host"])
    if not job.nodes:
        return None
    hosts = expand_hostlist(job.nodes)
    per_node = int(job.spec.get("resources", {}).get("tasks_per_node", 1))
    index = rank // max(1, per_node)
    return hosts[index] if index < len(hosts) else None


def _on(job: Job, rank: int) -> str:
    host = rank_host(job, rank)
    return f" on {host}" if host else ""


def _ran_out_of_time(job: Job) -> bool:
    """The current submission has had its time: counted from when it first ran (or, for a retry,
    from its own submission), so that SLURM's requeues within it count and earlier attempts do not."""
    started = max((moment for moment in (job.started_at, job.submitted_at) if moment), default=None)
    limit_min = float(job.spec.get("resources", {}).get("timeout_min", 0) or 0)
    return started is not None and limit_min > 0 and (utcnow() - started).total_seconds() >= limit_min * 60


def _rank0_stderr(job: Job, backend: Backend) -> str:
    if job.folder is None or job.external_id is None:
        return ""
    folder = Path(job.folder)
    tail = log_tail(folder, backend.log_path(folder, job.external_id, 0, "err"))
    return f"; rank 0 stderr ends:\n{tail}" if tail else ""
