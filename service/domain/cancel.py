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

CANCEL_CHUNK = 100  # jobs moved in one write transaction of a cancel


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
    # write_scope: on SQLite a row lock is no lock, so the reconciler's writes and these take turns.
    # A sweep's or a pipeline's cancel moves many jobs: in chunks, each its own transaction, so that
    # another user's write waits for one chunk at most, never for the whole cascade.
    jobs: list[Job] = []
    held: dict[int, tuple[str, str]] = {}
    for chunk in _chunks(job_ids):
        with write_scope(engine) as session:
            for job_id in chunk:
                job = _request_cancel(session, job_id, viewer)
                jobs.append(job)
                if job.id is not None and job.external_id is not None and not _ended(job):
                    held[job.id] = (job.backend, job.external_id)
    by_backend: dict[str, list[str]] = {}
    for backend_name, external_id in held.values():
        by_backend.setdefault(backend_name, []).append(external_id)
    for backend_name, external_ids in by_backend.items():
        require_backend(backends, backend_name).cancel(external_ids)
    if not held:
        return jobs
    ended = []
    for chunk in _chunks(job_ids):
        with write_scope(engine) as session:
            for job_id in chunk:
                job = get_job(session, job_id, viewer)
                session.refresh(job, with_for_update=True)  # the reconciler may have ended it meanwhile
                if job_id in held and not _ended(job):
                    record_transition(session, job, JobState.cancelled, CANCELLED_BY_USER)
                ended.append(job)
    return ended


def _ended(job: Job) -> bool:
    return is_terminal(JobState(job.state))


def _chunks(job_ids: Sequence[int]) -> list[Sequence[int]]:
    return [job_ids[start : start + CANCEL_CHUNK] for start in range(0, len(job_ids), CANCEL_CHUNK)]


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
