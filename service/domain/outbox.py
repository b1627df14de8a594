"""The notifications' outbox: notices written with the state change that causes them, turned into one
delivery per matching subscription (fan-out), and deliveries claimed, then settled, by the replica
that sends them (service.loops.notify). The caller owns the transaction.

Why an outbox: a webhook must never be lost (a service killed after a job's ending committed still
tells of it after its restart) and must never hold a loop up (a slow receiver, no answer). So the
transitions door writes one `Notice` row in the transaction of the move itself; nothing calls out
there. The notify loop reads notices later, in its own transactions, and sends with none open.

Two replicas never send one delivery together: a delivery is sent only under a lease
(`claimed_by`, `claimed_until`) taken by a conditional UPDATE, on PostgreSQL after SELECT ... FOR
UPDATE SKIP LOCKED, and settled only by the lease's holder. A replica killed mid-send leaves a lease
that expires; the resend carries the same delivery id, which the receiver may use to drop it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, or_, update
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from service.bulkhead import Bulkhead, Fault
from service.domain import webhook_events
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.notifications import ENDED, Delivery, Notice, Subscription
from service.ledger.models.pipelines import Pipeline
from service.states import TERMINAL_STATE_NAMES, JobState

# The moves that write a notice: endings, a start, and an attempt's end that another follows. The
# batch moves of the transitions door (queued, submitted, pending: the intake's and the
# dispatcher's, many jobs at once) are left out on purpose: they are noise, and their writers
# insert through Core without a row per job.
NOTIFIABLE: frozenset[JobState] = frozenset(
    {JobState.succeeded, JobState.failed, JobState.cancelled, JobState.timeout}
    | {JobState.running, JobState.retrying, JobState.requeued}
)
FAN_OUT_BATCH = 200
CLAIM_BATCH = 50
FAN_OUT = "notify fan-out"
MAX_ERROR = 500


def note_job(session: Session, job: Job, state: JobState, reason: str | None) -> None:
    """The door's one INSERT: `job` moved to `state` (one of NOTIFIABLE), in this transaction."""
    session.add(
        Notice(
            owner=job.owner,
            job_id=job.id,
            pipeline_id=job.pipeline_id,
            state=state.value,
            reason=reason,
            attempt=job.attempt,
        )
    )


def note_pipeline(session: Session, pipeline_id: int, state: str, reason: str | None) -> None:
    """A pipeline reached `state` (running, succeeded, failed, cancelled), in this transaction: the
    pipelines' domain calls this where it decides it."""
    pipeline = session.get(Pipeline, pipeline_id)
    assert pipeline is not None, "note a stored pipeline"
    session.add(Notice(owner=pipeline.owner, pipeline_id=pipeline_id, state=state, reason=reason))


def wants(on: Sequence[str], state: str) -> bool:
    """Whether a subscription's `on` covers `state`."""
    return state in on or (ENDED in on and state in TERMINAL_STATE_NAMES)


def matching(session: Session, notice: Notice) -> list[Subscription]:
    """The subscriptions a notice is for: bound to its job; bound to its pipeline (its own events and
    its jobs'); or bound to neither and its owner's. Each only when its `on` covers the state."""
    ways: list[ColumnElement[bool]] = [
        and_(
            col(Subscription.owner) == notice.owner,
            col(Subscription.job_id).is_(None),
            col(Subscription.pipeline_id).is_(None),
        )
    ]
    if notice.job_id is not None:
        ways.append(col(Subscription.job_id) == notice.job_id)
    if notice.pipeline_id is not None:
        ways.append(
            and_(col(Subscription.pipeline_id) == notice.pipeline_id, col(Subscription.job_id).is_(None))
        )
    found = session.exec(select(Subscription).where(or_(*ways)).order_by(col(Subscription.id))).all()
    return [one for one in found if wants(one.on, notice.state)]


def fan_out(session: Session, dashboard: str, guard: Bulkhead, limit: int = FAN_OUT_BATCH) -> int:
    """Turn up to `limit` notices into deliveries and delete them; returns how many were taken. Each
    notice in a savepoint of its own: one that fails stays for the next pass, until the bulkhead
    gives up on it (then it is dropped, with a warning in the log)."""
    query = select(Notice).order_by(col(Notice.id)).limit(limit).with_for_update(skip_locked=True)
    notices = session.exec(query).all()
    done: list[int] = []
    for notice in notices:
        assert notice.id is not None
        outcome = guard.guarded(notice.id, _deliveries_of(session, notice, dashboard), session)
        if not isinstance(outcome, Fault) or outcome.gives_up:
            done.append(notice.id)
    if done:
        session.connection().execute(delete(Notice).where(col(Notice.id).in_(done)))
    return len(notices)


def _deliveries_of(session: Session, notice: Notice, dashboard: str) -> Callable[[], None]:
    def work() -> None:
        subscriptions = matching(session, notice)
        if not subscriptions:
            return
        payload = _event(session, notice, dashboard)
        now = utcnow()
        for subscription in subscriptions:
            assert subscription.id is not None
            delivery_id = str(uuid.uuid4())
            session.add(
                Delivery(
                    delivery_id=delivery_id,
                    subscription_id=subscription.id,
                    owner=subscription.owner,
                    url=subscription.url,
                    job_id=notice.job_id,
                    pipeline_id=notice.pipeline_id,
                    event=payload["event"],
                    payload={"delivery_id": delivery_id, **payload},
                    next_at=now,
                    created_at=now,
                )
            )
        session.flush()

    return work


def _event(session: Session, notice: Notice, dashboard: str) -> dict[str, Any]:
    if notice.job_id is not None:
        job = session.get(Job, notice.job_id)
        assert job is not None, f"notice of job {notice.job_id}, which is not stored"
        row = job.model_dump(include={"id", "name", "owner", "created_at", "started_at", "finished_at",
                                      "pipeline_id"})  # fmt: skip
        return webhook_events.job_event(
            row, notice.state, notice.reason, notice.attempt, notice.time, dashboard
        )
    assert notice.pipeline_id is not None, "a notice is of a job or of a pipeline"
    pipeline = session.get(Pipeline, notice.pipeline_id)
    assert pipeline is not None, f"notice of pipeline {notice.pipeline_id}, which is not stored"
    row = pipeline.model_dump(include={"id", "name", "owner", "created_at", "finished_at"})
    return webhook_events.pipeline_event(row, notice.state, notice.reason, notice.time, dashboard)


@dataclass(frozen=True)
class Claimed:
    """A delivery this replica holds the lease of, with what sending it needs."""

    id: int
    delivery_id: str
    url: str
    event: str
    payload: dict[str, Any]
    attempts: int  # this try included
    secret: str | None  # None: its subscription was removed


def _due(now: datetime) -> ColumnElement[bool]:
    return and_(
        col(Delivery.status) == "pending",
        col(Delivery.next_at) <= now,
        or_(col(Delivery.claimed_until).is_(None), col(Delivery.claimed_until) < now),
    )


def work_waiting(session: Session) -> tuple[bool, bool]:
    """Whether any notice waits for its fan-out, and whether any delivery is due: two reads."""
    now = utcnow()
    notice = session.exec(select(Notice.id).limit(1)).first()
    due = session.exec(select(Delivery.id).where(_due(now)).limit(1)).first()
    return notice is not None, due is not None


def claim_due(session: Session, me: str, lease_s: float, limit: int = CLAIM_BATCH) -> list[Claimed]:
    """Take the lease of up to `limit` due pending deliveries (each try counted as it is taken: a
    replica that dies sending it has spent it). Commit before sending."""
    now = utcnow()
    query = (
        select(Delivery.id).where(_due(now)).order_by(col(Delivery.next_at)).limit(limit)
        .with_for_update(skip_locked=True)
    )  # fmt: skip
    taken: list[int] = []
    for delivery_id in session.exec(query).all():
        changed = session.connection().execute(
            update(Delivery)
            .where(col(Delivery.id) == delivery_id, _due(now))
            .values(claimed_by=me, claimed_until=now + timedelta(seconds=lease_s),
                    attempts=col(Delivery.attempts) + 1)
        )  # fmt: skip
        if changed.rowcount == 1:
            assert delivery_id is not None
            taken.append(delivery_id)
    if not taken:
        return []
    rows = session.exec(
        select(Delivery, Subscription.secret)
        .join(Subscription, col(Subscription.id) == col(Delivery.subscription_id), isouter=True)
        .where(col(Delivery.id).in_(taken))
        .execution_options(populate_existing=True)
    ).all()
    return [
        Claimed(row.id or 0, row.delivery_id, row.url, row.event, row.payload, row.attempts, secret)
        for row, secret in rows
    ]


@dataclass(frozen=True)
class Outcome:
    """How one try went: `delivered`, or why not (`error`; `permanent`: trying again cannot help)."""

    delivered: bool
    status: int | None = None
    error: str | None = None
    permanent: bool = False


def settle(
    session: Session,
    claimed: Claimed,
    me: str,
    outcome: Outcome,
    *,
    max_attempts: int,
    backoff: Callable[[int], float],
) -> None:
    """Record a try: delivered; failed for good (a permanent refusal, or the last try); or pending
    again after `backoff(tries so far)` seconds. Only while this replica still holds the lease."""
    now = utcnow()
    values: dict[str, Any] = {"claimed_by": None, "claimed_until": None, "last_status": outcome.status}
    if outcome.delivered:
        values.update(status="delivered", delivered_at=now, last_error=None)
    else:
        values["last_error"] = (outcome.error or "failed")[:MAX_ERROR]
        if outcome.permanent or claimed.attempts >= max_attempts:
            values["status"] = "failed"
        else:
            values["next_at"] = now + timedelta(seconds=backoff(claimed.attempts))
    session.connection().execute(
        update(Delivery)
        .where(col(Delivery.id) == claimed.id, col(Delivery.claimed_by) == me)
        .values(**values)
    )
