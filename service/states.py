"""The one job state machine shared by every backend, and the one list of its terminal states.

Pure standard library: the HTTP client and the CLI import it too, and the dashboard gets the same
lists from /dashboard/states.js, which the service writes from this module.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal


class JobState(str, Enum):
    """In the order of a job's life (the dashboard lists them so): the active states, then the endings."""

    waiting = "waiting"  # stored, waits for the jobs it runs after (service.domain.dependencies)
    queued = "queued"  # stored, not yet handed to a backend
    submitted = "submitted"  # the backend accepted it
    pending = "pending"  # waiting in the scheduler's queue
    running = "running"
    preempted = "preempted"  # the scheduler stopped it; it will come back
    requeued = "requeued"  # back in the scheduler's queue after preemption (attempt + 1)
    retrying = "retrying"  # an attempt ended and the job's retry policy starts another (attempt + 1)
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    timeout = "timeout"


TERMINAL_STATES: frozenset[JobState] = frozenset(
    {JobState.succeeded, JobState.failed, JobState.cancelled, JobState.timeout}
)
TERMINAL_STATE_NAMES: frozenset[str] = frozenset(state.value for state in TERMINAL_STATES)  # as JSON has them
ACTIVE_STATES: frozenset[JobState] = frozenset(set(JobState) - TERMINAL_STATES)
# States in which the service holds the job, waiting to hand it to a backend (a retry after its backoff).
DISPATCHABLE_STATES: frozenset[JobState] = frozenset({JobState.queued, JobState.retrying})
# States in which a backend holds the job and the reconcile loop must watch it.
WATCHED_STATES: frozenset[JobState] = frozenset(ACTIVE_STATES - DISPATCHABLE_STATES - {JobState.waiting})

_ENDED = TERMINAL_STATES | {JobState.retrying}  # how an attempt the scheduler held can end
ALLOWED_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    # Its dependencies met, it is queued; one that can no longer be met cancels it (and a user may).
    JobState.waiting: frozenset({JobState.queued, JobState.cancelled, JobState.failed}),
    JobState.queued: frozenset({JobState.submitted, JobState.failed, JobState.cancelled}),
    JobState.submitted: frozenset({JobState.pending, JobState.running, JobState.preempted} | _ENDED),
    JobState.pending: frozenset({JobState.running, JobState.preempted} | _ENDED),
    JobState.running: frozenset({JobState.pending, JobState.preempted, JobState.requeued} | _ENDED),
    JobState.preempted: frozenset({JobState.requeued, JobState.pending, JobState.running} | _ENDED),
    JobState.requeued: frozenset({JobState.pending, JobState.running, JobState.preempted} | _ENDED),
    JobState.retrying: frozenset({JobState.submitted, JobState.failed, JobState.cancelled}),
    JobState.succeeded: frozenset(),
    JobState.failed: frozenset(),
    JobState.cancelled: frozenset(),
    JobState.timeout: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, current: JobState, target: JobState) -> None:
        super().__init__(f"a job cannot go from {current.value} to {target.value}")
        self.current = current
        self.target = target


def is_terminal(state: JobState) -> bool:
    return state in TERMINAL_STATES


def can_transition(current: JobState, target: JobState) -> bool:
    return target in ALLOWED_TRANSITIONS[current]


def check_transition(current: JobState, target: JobState) -> None:
    """Raise IllegalTransition unless current -> target is allowed. The only place that decides."""
    if not can_transition(current, target):
        raise IllegalTransition(current, target)


def starts_new_attempt(target: JobState) -> bool:
    """Going back to the scheduler's queue after a preemption, or to ours for a retry, begins attempt + 1."""
    return target in (JobState.requeued, JobState.retrying)


# Why an attempt ended, in the words retry policies use (service.domain.endings decides which).
# hang: the watchdog found the attempt stalled and its spec says `on_stall: "fail"`.
# pruned: a sweep's early stopping stopped the trial (state `cancelled`; service.loops.sweep_pruning).
EndingKind = Literal["failure", "node_failure", "preemption", "timeout", "oom", "cancel", "hang", "pruned"]
