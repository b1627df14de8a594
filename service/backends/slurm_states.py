"""Every job state SLURM can print, and what it means for our JobState.

squeue and sacct print one word per job: a state flag when one is set (COMPLETING, REQUEUED, ...),
else the base state (slurm_protocol_defs.c: job_state_string). sacct adds the canceller's uid to
CANCELLED ("CANCELLED by 0"). Preemption and requeueing are not failures: the job comes back.
"""

from __future__ import annotations

from service.states import EndingKind, JobState


class UnknownSlurmState(ValueError):
    """A state word this table does not know (a newer SLURM); the caller leaves the job unchanged."""


# word -> (our state, the reason we add; None when the state says it all)
SLURM_STATES: dict[str, tuple[JobState, str | None]] = {
    # base states
    "PENDING": (JobState.pending, None),
    "RUNNING": (JobState.running, None),
    "SUSPENDED": (JobState.preempted, "suspended"),  # holds its nodes, resumes later (PreemptMode=SUSPEND)
    "COMPLETED": (JobState.succeeded, None),
    "CANCELLED": (JobState.cancelled, None),
    "FAILED": (JobState.failed, None),
    "TIMEOUT": (JobState.timeout, None),
    "NODE_FAIL": (JobState.failed, "node failure"),
    "PREEMPTED": (JobState.preempted, None),
    "BOOT_FAIL": (JobState.failed, "node boot failure"),
    "DEADLINE": (JobState.timeout, "deadline reached"),
    "OUT_OF_MEMORY": (JobState.failed, "out of memory"),
    # state flags, shown instead of the base state while they are set
    "COMPLETING": (JobState.running, "completing"),  # the ranks are ending; the final word follows
    "STAGE_OUT": (JobState.running, "staging out"),
    "CONFIGURING": (JobState.pending, "configuring (nodes booting)"),  # allocated, not started yet
    "RESIZING": (JobState.running, "resizing"),
    "REQUEUED": (JobState.requeued, None),
    "REQUEUE_FED": (JobState.requeued, "requeued by the federation"),
    "REQUEUE_HOLD": (JobState.requeued, "requeued and held"),
    "SPECIAL_EXIT": (JobState.failed, "special exit (requeued and held by the job)"),
    "STOPPED": (JobState.preempted, "stopped (SIGSTOP)"),
    "REVOKED": (JobState.cancelled, "revoked (runs on another cluster of the federation)"),
    "RESV_DEL_HOLD": (JobState.pending, "held: its reservation was deleted"),
    "SIGNALING": (JobState.running, "signaling"),
    # newer releases (23.02+); harmless to know early
    "POWER_UP_NODE": (JobState.pending, "powering up nodes"),
    "LAUNCH_FAILED": (JobState.failed, "launch failed"),
    "RECONFIG_FAIL": (JobState.failed, "node reconfiguration failed"),
    "UPDATE_DB": (JobState.pending, "updating the accounting database"),
}


# The endings SLURM can name the kind of (the rest are told by the job's files: service.domain.endings).
SLURM_KINDS: dict[str, EndingKind] = {
    "NODE_FAIL": "node_failure",
    "BOOT_FAIL": "node_failure",
    "LAUNCH_FAILED": "node_failure",
    "OUT_OF_MEMORY": "oom",
    "PREEMPTED": "preemption",  # an ending only once the job has left the queue (slurm_parse.to_status)
}


def slurm_kind(raw: str) -> EndingKind | None:
    return SLURM_KINDS.get(raw.strip().upper().rstrip("+").partition(" ")[0])


def map_slurm_state(raw: str) -> tuple[JobState, str | None]:
    """Map one state word from squeue/sacct to (our state, reason). Raises UnknownSlurmState.

    "CANCELLED by 1000" -> (cancelled, "cancelled by uid 1000"); case and surrounding blanks are ignored;
    sacct's "+" (a truncated word in fixed-width output) is dropped.
    """
    text = raw.strip().upper().rstrip("+")
    word, _, rest = text.partition(" ")
    if word not in SLURM_STATES:
        raise UnknownSlurmState(f"unknown SLURM job state {raw.strip()!r}")
    state, reason = SLURM_STATES[word]
    if word == "CANCELLED" and rest.startswith("BY "):
        reason = f"cancelled by uid {rest[3:].strip()}"
    return state, reason
