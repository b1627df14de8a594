"""The one door for a job's state: every move, of one job or of many, with what follows it.

The state machine (service.states) says which moves are allowed; this module says what follows one:
the job's columns (its state and reason; when it was submitted, started, finished; the run it now is;
its attempt), the event row, and the row of the attempt a move ends. Every writer goes through it: the
intake (new jobs, queued: `record_accepted`), the dispatcher (submitted, or failed at dispatch), the
reconciler (pending, running, the endings; `end_attempt` decides a retry), and a user's cancel.
`record_transition` moves one job held as an ORM object; `record_submissions`, `record_waiting` and
`record_accepted` move many at once through Core statements built from the same rules (`_columns`,
`_event`), and stamp them for the ledger clock themselves: no caller writes a state or an event, or
remembers note_changed. A move to a state webhooks tell of (service.domain.outbox.NOTIFIABLE) writes
its notice here too, and works the job's goodput out again (service.domain.goodput: the part its time
goes to changes there); the batch moves never go to one of those states. A restart in place is no move:
`record_restart` writes its event (and its `job.restarted` notice).

A user's cancel is a flag (`Job.cancel_requested`), not a state. Until the scheduler has stopped it,
a cancelled job still is what it was (queued, pending, running: its ranks are exiting), and every
backend reports it so; a state "cancelling" would have to be told apart from each of them in every
status mapping, and would say less. The flag's one rule is here: a job whose cancel was requested moves
to `cancelled` instead of any other ending, instead of a retry, and instead of `submitted` (its run
must then be stopped: the caller learns it from the state returned).

`updated_at` is never set here: the ledger clock stamps every job a transaction changed at its commit
(service.ledger.clock), which is what orders changes for polling readers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import bindparam, insert, update
from sqlmodel import Session, col, func, select

from service.domain import goodput
from service.domain.endings import CANCELLED_BY_USER, Ending
from service.domain.outbox import NOTIFIABLE, note_job, note_restart
from service.domain.pipeline_state import settle_pipeline
from service.ledger.clock import note_changed, stamp_jobs
from service.ledger.models.columns import utcnow
from service.ledger.models.history import JobAttempt, JobEvent
from service.ledger.models.jobs import Job, RetryPolicy
from service.ledger.sql import id_conditions
from service.states import EndingKind, JobState, check_transition, is_terminal, starts_new_attempt

# How an attempt ended when the caller does not say (service.domain.endings says it for the reconciler).
DEFAULT_KINDS: dict[JobState, EndingKind] = {
    JobState.failed: "failure",
    JobState.timeout: "timeout",
    JobState.cancelled: "cancel",
    JobState.requeued: "preemption",
}
# The batch moves below write no notice: none of them goes to a state webhooks tell of.
assert not NOTIFIABLE & {JobState.queued, JobState.submitted, JobState.pending}, (
    "batch moves would need notices"
)
ACCEPTED = "accepted"  # the reason of every job's first event


def cancel_overrides(target: JobState) -> bool:
    """Whether a requested cancel turns a move to `target` into `cancelled`."""
    return target is not JobState.succeeded and (
        is_terminal(target) or target in (JobState.submitted, JobState.retrying)
    )


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
    external_id: str | None = None,
) -> JobState:
    """Move `job` to `target` (raises IllegalTransition when the machine forbids it); the state it is
    in afterwards: `cancelled` instead of `target` when its user asked (see the module docstring).

    A move to `submitted` names the backend's run (`external_id`), which the job now is. A target
    that ends the attempt (a terminal state, a requeue, a retry) also writes the attempt's row: how it
    ended (`ended_as`, default `target`), why (`kind`, and `ended_because`, default `reason`) and where
    it ran. Already in `target`, only a new reason is written (no event).
    """
    current = JobState(job.state)
    if target is JobState.submitted:
        assert external_id is not None, "a submitted job is the backend's run"
        job.external_id, job.run_attempt = external_id, job.attempt
    if job.cancel_requested and cancel_overrides(target):  # the same reason whoever ends it
        target, reason, kind, ended_as, ended_because = (
            JobState.cancelled,
            CANCELLED_BY_USER,
            None,
            None,
            None,
        )
    if current is target:
        if reason is not None and reason != job.reason:
            job.reason = reason
            session.add(job)
        return current
    check_transition(current, target)
    now = utcnow()
    assert job.id is not None, "flush the job before recording its history"
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
    if starts_new_attempt(target) or is_terminal(target):  # the watchdog's reading of the attempt
        job.progress_at = job.report_times = job.stalled_at = job.stall_reason = None
    for name, value in _columns(target, reason, now).items():
        setattr(job, name, value)
    if target is JobState.running:
        job.started_at = job.started_at or now
        job.attempt_started_at = job.attempt_started_at or now
    session.add(job)
    session.add(JobEvent(**_event(job.id, current, target, reason, job.attempt, now)))
    if target in NOTIFIABLE:  # its webhooks' outbox, in this transaction (service.domain.outbox)
        note_job(session, job, target, reason)
        goodput.refresh(session, job, now)  # a start or an end: the part its time goes to changes
    if job.pipeline_id is not None and is_terminal(target):  # its pipeline may have ended with it
        settle_pipeline(session, job.pipeline_id)
    return target


STALLED = "stalled: "
RESUMED = "progress resumed after a stall of "


def record_stall(session: Session, job: Job, reason: str) -> None:
    """Flag the running `job` stalled (service.domain.watchdog decided), with its event. Not a state:
    the job still runs, and its state machine does not change."""
    assert job.id is not None, "flag a stored job"
    now = utcnow()
    job.stalled_at, job.stall_reason = now, reason
    session.add(job)
    state = JobState(job.state)
    session.add(JobEvent(**_event(job.id, state, state, STALLED + reason, job.attempt, now)))


def clear_stall(session: Session, job: Job) -> None:
    """The stalled `job` makes progress again: the flag goes, with an event saying how long it stood."""
    if job.stalled_at is None:
        return
    assert job.id is not None, "flag a stored job"
    now = utcnow()
    lasted = max(0.0, (now - job.stalled_at).total_seconds())
    job.stalled_at = job.stall_reason = None
    session.add(job)
    state = JobState(job.state)
    session.add(JobEvent(**_event(job.id, state, state, f"{RESUMED}{lasted:.0f} s", job.attempt, now)))


def record_restart(session: Session, job: Job, text: str, *, notify: bool) -> None:
    """A restart in place of the running `job` (or its supervisor giving up), with its event; with
    `notify`, a `job.restarted` webhook too. Not a state: the attempt goes on, in the same run."""
    assert job.id is not None, "record a stored job's restart"
    now = utcnow()
    state = JobState(job.state)
    session.add(JobEvent(**_event(job.id, state, state, text, job.attempt, now)))
    if notify:
        note_restart(session, job, text)


def _columns(target: JobState, reason: str | None, now: datetime) -> dict[str, Any]:
    """The columns a move to `target` sets, whatever the job held: for one job and for many alike."""
    columns: dict[str, Any] = {"state": target, "reason": reason}
    if target is not JobState.pending:
        columns["expected_start_at"] = None  # a start estimate means something only while it waits
    if target is JobState.submitted:  # a new run: nothing claims it, nothing waits to retry it
        columns.update(submitted_at=now, retry_at=None, claimed_by=None, claimed_at=None)
    if is_terminal(target):
        columns.update(finished_at=now, folder_bytes=None)  # its final size is measured next
    return columns


def _event(
    job_id: int, current: JobState | None, target: JobState, reason: str | None, attempt: int, now: datetime
) -> dict[str, Any]:
    return {"job_id": job_id, "from_state": current, "to_state": target, "reason": reason,
            "attempt": attempt, "time": now}  # fmt: skip


def end_attempt(session: Session, job: Job, ending: Ending, exit_code: int | None = None) -> None:
    """End the job's current attempt as `ending` says: with a new attempt after the backoff when its
    retry policy covers this kind of ending and has retries left, else for good."""
    if ending.state is JobState.succeeded:
        job.result = ending.result
    # A cancelled job's ranks may report lost peers while the cancel stops them: the door makes the
    # user's cancel the ending (and no retry follows it).
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
    """Move many jobs to submitted at once, none of them with a cancel requested (the dispatcher
    read them row-locked): record_transition's rules and columns, in an executemany UPDATE and one
    INSERT of their events instead of an ORM object per job."""
    if not accepted:
        return
    for one in accepted:
        check_transition(one.current, JobState.submitted)
    now = utcnow()
    columns = {
        name: value for name, value in _columns(JobState.submitted, None, now).items() if name != "reason"
    }
    session.connection().execute(
        update(Job)
        .where(col(Job.id) == bindparam("b_id"))
        .values(
            **columns,
            reason=bindparam("b_reason"),
            external_id=bindparam("b_external_id"),
            run_attempt=bindparam("b_attempt"),
        ),
        [
            {"b_id": one.job_id, "b_reason": one.reason, "b_external_id": one.external_id,
             "b_attempt": one.attempt}
            for one in accepted
        ],
    )  # fmt: skip
    events = [
        _event(one.job_id, one.current, JobState.submitted, one.reason, one.attempt, now) for one in accepted
    ]
    _insert_events(session, events)


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
    events: list[dict[str, Any]] = []
    for reason, job_ids in by_reason.items():
        for condition in id_conditions(col(Job.id), job_ids):
            rows = session.connection().execute(
                update(Job)
                .where(
                    condition, col(Job.state) == JobState.submitted, col(Job.updated_at) <= unchanged_since
                )
                .values(**_columns(JobState.pending, reason, now))
                .returning(col(Job.id), col(Job.attempt))
            )
            events += [
                _event(row["id"], JobState.submitted, JobState.pending, reason, row["attempt"], now)
                for row in rows.mappings()
            ]
    _insert_events(session, events)
    return [event["job_id"] for event in events]


def record_accepted(session: Session, jobs: Sequence[tuple[int, datetime, JobState, str | None]]) -> datetime:
    """New jobs (id, when they were made, queued or waiting, the reason they were stored with),
    inserted by the intake: their first event, and the ledger clock's stamp, as the last statement
    before COMMIT (the clock is the last lock a transaction takes). Returns the stamp."""
    for _, _, state, _ in jobs:
        assert state in (JobState.queued, JobState.waiting), "a new job is queued, or waits for others"
    _insert_events(
        session,
        [_event(job_id, None, state, reason or ACCEPTED, 1, made) for job_id, made, state, reason in jobs],
        stamp=False,
    )
    return stamp_jobs(session, [job[0] for job in jobs])


def _insert_events(session: Session, events: list[dict[str, Any]], *, stamp: bool = True) -> None:
    """The events of jobs moved through Core, and their stamp at commit (the ORM's are the clock's
    hooks')."""
    if not events:
        return
    session.connection().execute(insert(JobEvent), events)
    if stamp:
        note_changed(session, [event["job_id"] for event in events])
