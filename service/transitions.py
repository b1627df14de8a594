"""Apply a state change to a job row: the state machine, the event row and the timestamps together."""

from __future__ import annotations

from sqlmodel import Session

from service.models import Job, JobEvent, utcnow
from service.states import JobState, check_transition, is_terminal, starts_new_attempt


def record_transition(
    session: Session,
    job: Job,
    target: JobState,
    reason: str | None = None,
    *,
    exit_code: int | None = None,
) -> bool:
    """Move `job` to `target` (raises IllegalTransition when the machine forbids it).

    Returns False, changing nothing, when the job is already in `target` with the same reason.
    """
    current = JobState(job.state)
    if current is target:
        if reason is not None and reason != job.reason:
            job.reason = reason
            job.updated_at = utcnow()
            session.add(job)
        return False
    check_transition(current, target)
    now = utcnow()
    if starts_new_attempt(target):
        job.attempt += 1
    job.state = target
    job.reason = reason
    if exit_code is not None:
        job.exit_code = exit_code
    if target is JobState.submitted:
        job.submitted_at = now
    if target is JobState.running and job.started_at is None:
        job.started_at = now
    if is_terminal(target):
        job.finished_at = now
    job.updated_at = now
    session.add(job)
    assert job.id is not None, "flush the job before recording its history"
    session.add(
        JobEvent(
            job_id=job.id, from_state=current, to_state=target, reason=reason, attempt=job.attempt, time=now
        )
    )
    return True
