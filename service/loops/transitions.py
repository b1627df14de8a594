"""Apply a state change to a job row: the state machine, the event row and the timestamps together.

`updated_at` is never set here: the ledger clock stamps every job a transaction changed at its commit
(service.ledger.clock), which is what orders changes for polling readers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import bindparam, insert, update
from sqlmodel import Session, col, func, select

from service.domain.endings import Ending
from service.ledger.clock import note_changed
from service.ledger.models import Job, JobAttempt, JobEvent, RetryPolicy, utcnow
from service.ledger.sql import id_conditions
from service.states import EndingKind, JobState, check_transition, is_terminal, starts_new_attempt

# How an attempt ended when the caller does not say (service.domain.endings says it for the reconciler).
DEFAULT_KINDS: dict[JobState, EndingKind] = {
    JobState.failed: "failure",
    JobState.timeout: "timeout",
    JobState.cancelled: "cancel",
    JobState.requeued: "preemption",
}


def record_transition(
    session: Session,
    job: Job,
    target: JobState,
    reason: str | None = None,
    *,
    exit_code: int | None = None,
    kind: EndingKind | None = None,
    ended_as: JobState | None = None,
    ended_because: str | None = None,
) -> bool:
    """Move `job` to `target` (raises IllegalTransition when the machine forbids it).

    A target that ends the attempt (a terminal state, a requeue, a retry) also writes the attempt's
    row: how it ended (`ended_as`, default `target`), why (`kind`, and `ended_because`, default
    `reason`) and where it ran.
    Returns False, changing nothing, when the job is already in `target` with the same reason.
    """
    current = JobState(job.state)
    if current is target:
        if reason is not None and reason != job.reason:
            job.reason = reason
            session.add(job)
        return False
    check_transition(current, target)
    now = utcnow()
    assert job.id is not None, "flush the job before recording its history"
    if target is not JobState.pending:
        job.expected_start_at = None  # a start estimate means something only while it waits
    if exit_code is not None:
        job.exit_code = exit_code
    if is_terminal(target) or starts_new_attempt(target):
        ended = ended_as or target
        session.add(
            JobAttempt(
                job_id=job.id,
                attempt=job.attempt,
                state=ended,
                kind=kind or DEFAULT_KINDS.get(ended),
                reason=ended_because or reason,
                exit_code=exit_code,
                external_id=job.external_id,
                nodes=job.nodes,
                placement=job.placement,
                started_at=job.attempt_started_at,
                ended_at=now,
            )
        )
    if starts_new_attempt(target):
        job.attempt += 1
        job.attempt_started_at = job.placement = job.nodes = None  # the next attempt's, once known
    job.state = target
    job.reason = reason
    if target is JobState.submitted:
        job.submitted_at = now
    if target is JobState.running:
        job.started_at = job.started_at or now
        job.attempt_started_at = job.attempt_started_at or now
    if is_terminal(target):
        job.finished_at = now
        job.folder_bytes = None  # its final size is measured next (service.domain.retention.measure_ended)
    session.add(job)
    session.add(
        JobEvent(
            job_id=job.id, from_state=current, to_state=target, reason=reason, attempt=job.attempt, time=now
        )
    )
    return True


def end_attempt(session: Session, job: Job, ending: Ending, exit_code: int | None = None) -> None:
    """End the job's current attempt as `ending` says: with a new attempt after the backoff when its
    retry policy covers this kind of ending and has retries left, else for good."""
    if ending.state is JobState.succeeded:
        job.result = ending.result
    if job.cancel_requested and ending.state is not JobState.succeeded:
        # Its ranks may report lost peers while the cancel stops them: the user's cancel is the ending.
        record_transition(session, job, JobState.cancelled, "cancelled by user", exit_code=exit_code)
        return
    policy = RetryPolicy.model_validate(job.retries) if job.retries else None
    retried = _retries_so_far(session, job) if policy is not None else 0
    if policy is None or ending.kind not in policy.on or retried >= policy.max:
        record_transition(session, job, ending.state, ending.reason, exit_code=exit_code, kind=ending.kind)
        return
    wait_s = policy.wait_s(retried + 1)
    job.retry_at = utcnow() + timedelta(seconds=wait_s)
    reason = (
        f"attempt {job.attempt} ended ({ending.kind}): {ending.reason}\n"
        f"retry {retried + 1} of {policy.max}: attempt {job.attempt + 1} in {wait_s:g} s"
    )
    record_transition(
        session,
        job,
        JobState.retrying,
        reason,
        exit_code=exit_code,
        kind=ending.kind,
        ended_as=ending.state,
        ended_because=ending.reason,
    )
    job.external_id = None  # the next attempt gets the backend's new id; this one is in its attempt row


def _retries_so_far(session: Session, job: Job) -> int:
    """Attempts of this job its retry policy started: the ended ones, less those SLURM requeued."""
    query = select(func.count()).where(
        col(JobAttempt.job_id) == job.id, col(JobAttempt.state) != JobState.requeued.value
    )
    return int(session.exec(query).one())


@dataclass(frozen=True)
class Submission:
    """One job a backend accepted, as the dispatcher read it (row-locked) before recording it."""

    job_id: int
    current: JobState
    attempt: int
    external_id: str
    reason: str


def record_submissions(session: Session, accepted: Sequence[Submission]) -> None:
    """Move many jobs to submitted at once: record_transition's rules and columns, in two statements
    (an executemany UPDATE and one INSERT of their events) instead of an ORM object per job.

    Also releases the dispatcher's claim. The jobs are stamped by the ledger clock at commit.
    """
    if not accepted:
        return
    for one in accepted:
        check_transition(one.current, JobState.submitted)
    now = utcnow()
    connection = session.connection()
    connection.execute(
        update(Job)
        .where(col(Job.id) == bindparam("b_id"))
        .values(
            state=JobState.submitted,
            reason=bindparam("b_reason"),
            external_id=bindparam("b_external_id"),
            run_attempt=bindparam("b_attempt"),
            submitted_at=now,
            retry_at=None,
            claimed_by=None,
            claimed_at=None,
        ),
        [
            {"b_id": one.job_id, "b_reason": one.reason, "b_external_id": one.external_id,
             "b_attempt": one.attempt}
            for one in accepted
        ],
    )
    connection.execute(
        insert(JobEvent),
        [
            {
                "job_id": one.job_id,
                "from_state": one.current,
                "to_state": JobState.submitted,
                "reason": one.reason,
                "attempt": one.attempt,
                "time": now,
            }
            for one in accepted
        ],
    )
    note_changed(session, [one.job_id for one in accepted])


def record_waiting(
    session: Session, reasons: Mapping[int, str | None], *, unchanged_since: datetime
) -> list[int]:
    """Move many submitted jobs to pending at once (the scheduler queued them): a few statements per
    distinct reason instead of a row lock and an ORM object per job. Returns the ids it moved.

    A job is moved only while it is still submitted and unchanged since `unchanged_since` (when the
    scheduler was asked): one another replica, or a cancel, wrote meanwhile is left to the next tick.
    """
    check_transition(JobState.submitted, JobState.pending)
    by_reason: dict[str | None, list[int]] = {}
    for job_id, reason in reasons.items():
        by_reason.setdefault(reason, []).append(job_id)
    now = utcnow()
    moved: list[tuple[int, int, str | None]] = []  # (job id, attempt, reason)
    for reason, job_ids in by_reason.items():
        for condition in id_conditions(col(Job.id), job_ids):
            rows = session.connection().execute(
                update(Job)
                .where(
                    condition,
                    col(Job.state) == JobState.submitted,
                    col(Job.updated_at) <= unchanged_since,
                )
                .values(state=JobState.pending, reason=reason)
                .returning(col(Job.id), col(Job.attempt))
            )
            moved.extend((row["id"], row["attempt"], reason) for row in rows.mappings())
    if moved:
        session.connection().execute(
            insert(JobEvent),
            [
                {"job_id": job_id, "from_state": JobState.submitted, "to_state": JobState.pending,
                 "reason": reason, "attempt": attempt, "time": now}
                for job_id, attempt, reason in moved
            ],
        )  # fmt: skip
        note_changed(session, [job_id for job_id, _, _ in moved])
    return [job_id for job_id, _, _ in moved]
