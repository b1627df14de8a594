"""A job's history as readers list it: its state changes, its attempts, its reported metric rows.
Never imports FastAPI; the caller owns the transaction."""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from service.domain.auth import Principal
from service.domain.jobs import get_job
from service.ledger.models.history import JobAttempt, JobAttemptPublic, JobEvent
from service.ledger.models.metrics import JobMetric
from service.states import JobState


def list_events(session: Session, job_id: int, viewer: Principal) -> Sequence[JobEvent]:
    get_job(session, job_id, viewer)
    query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(col(JobEvent.id))
    return session.exec(query).all()


def list_attempts(session: Session, job_id: int, viewer: Principal) -> list[JobAttemptPublic]:
    """Every attempt, the first first: the ended ones from their rows, the current one (when the job
    is not finished) from the job itself."""
    job = get_job(session, job_id, viewer)
    query = select(JobAttempt).where(JobAttempt.job_id == job_id).order_by(col(JobAttempt.attempt))
    attempts = [JobAttemptPublic.model_validate(row, from_attributes=True) for row in session.exec(query)]
    if not attempts or attempts[-1].attempt < job.attempt:
        state = JobState(job.state)
        current = JobAttemptPublic.model_validate(
            {
                "attempt": job.attempt,
                "state": state,
                "kind": None,
                "reason": job.reason,
                "exit_code": None,
                "external_id": job.external_id,
                "nodes": job.nodes if state is not JobState.retrying else None,
                "placement": job.placement,
                "started_at": job.attempt_started_at,
                "ended_at": None,
            }
        )
        attempts.append(current)
    return attempts


def list_metrics(
    session: Session,
    job_id: int,
    viewer: Principal,
    *,
    name: str | None = None,
    after_step: int | None = None,
) -> Sequence[JobMetric]:
    get_job(session, job_id, viewer)
    query = select(JobMetric).where(JobMetric.job_id == job_id)
    if name:
        query = query.where(JobMetric.name == name)
    if after_step is not None:
        query = query.where(JobMetric.step > after_step)
    return session.exec(query.order_by(col(JobMetric.attempt), col(JobMetric.step), col(JobMetric.id))).all()
