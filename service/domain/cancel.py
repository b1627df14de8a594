"""Cancelling jobs: the request committed first, then one scheduler call per backend, then the jobs
ended. Never imports FastAPI; its own transactions (commit, then call out)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.backends.base import Backend
from service.domain import audit
from service.domain.auth import Principal
from service.domain.endings import CANCELLED_BY_USER
from service.domain.jobs import get_job, require_backend
from service.domain.transitions import record_transition
from service.ledger.db import write_scope
from service.ledger.models.jobs import Job
from service.states import DISPATCHABLE_STATES, JobState, is_terminal


def cancel_job(engine: Engine, job_id: int, backends: Mapping[str, Backend], viewer: Principal) -> Job:
    """Idempotent: a terminal job is returned as it is; anything else ends up cancelled."""
    return cancel_jobs(engine, [job_id], backends, viewer)[0]


def cancel_jobs(
    engine: Engine, job_ids: Sequence[int], backends: Mapping[str, Backend], viewer: Principal
) -> list[Job]:
    """Cancel these jobs (all visible to `viewer`) with one scheduler call per backend; idempotent.

    Its own transactions, because the scheduler is called between them: the request is committed
    first and the row locks released, since `scancel` may take many seconds and a job row locked that
    long stalls the reconciler and every other writer of the job. When the scheduler cannot be told,
    the raised BackendError answers the caller; the jobs keep `cancel_requested` and run on until a
    retried cancel gets through.
    """
    # write_scope: on SQLite a row lock is no lock, so the reconciler's writes and these take turns
    with write_scope(engine) as session:
        jobs = [_request_cancel(session, job_id, viewer) for job_id in job_ids]
        held = {
            job.id: (job.backend, job.external_id)
            for job in jobs
            if job.id is not None and job.external_id is not None and not is_terminal(JobState(job.state))
        }
    by_backend: dict[str, list[str]] = {}
    for backend_name, external_id in held.values():
        by_backend.setdefault(backend_name, []).append(external_id)
    for backend_name, external_ids in by_backend.items():
        require_backend(backends, backend_name).cancel(external_ids)
    if not held:
        return jobs
    with write_scope(engine) as session:
        ended = []
        for job_id in job_ids:
            job = get_job(session, job_id, viewer)
            session.refresh(job, with_for_update=True)  # the reconciler may have ended it meanwhile
            if job_id in held and not is_terminal(JobState(job.state)):
                record_transition(session, job, JobState.cancelled, CANCELLED_BY_USER)
            ended.append(job)
    return ended


def _request_cancel(session: Session, job_id: int, viewer: Principal) -> Job:
    """Flag the job for cancelling and end it at once where no scheduler holds it.

    A job still queued (or retrying) may be in a dispatcher's hands right now: the flag makes the
    dispatcher cancel what it submits instead of letting it run.
    """
    job = get_job(session, job_id, viewer)
    # Decide on the row as it is now, locked: a reconciler (this replica's or another's) may have just
    # ended the job, and two `cancelled` events for one cancel would be a lie in its history.
    session.refresh(job, with_for_update=True)
    state = JobState(job.state)
    if is_terminal(state):
        return job
    audit.record(session, viewer.user, "job.cancel", f"job {job_id}", f"owner={job.owner} was={state.value}")
    job.cancel_requested = True
    session.add(job)
    if job.external_id is None and (state not in DISPATCHABLE_STATES or job.claimed_by is None):
        record_transition(session, job, JobState.cancelled, CANCELLED_BY_USER)
    return job
