"""The notifications' outbox: notices written with the state change that causes them, and turned
into one delivery per matching subscription (fan-out). The caller owns the transaction. Claiming,
sending and settling deliveries: service.domain.deliveries and service.loops.notify.

Why an outbox: a webhook must never be lost (a service killed after a job's ending committed still
tells of it after its restart) and must never hold a loop up (a slow receiver, no answer). So the
transitions door writes one `Notice` row in the transaction of the move itself; nothing calls out
there. The notify loop reads notices later, in its own transactions, and sends with none open.

Fan-out is done in chunks: one call looks at no more than `budget` subscriptions, so a notice that
matches thousands (a pipeline cancelled with many subscriptions) holds the ledger's write lock (all
of it, on SQLite) for a chunk at a time. A notice keeps its cursor (`fanned_to`, the last
subscription id looked at) in the chunk's transaction and is deleted with its last chunk: a crash
between chunks neither loses a delivery nor makes one twice.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from typing import Any

from sqlalchemy import and_, func, or_
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
RESTARTED = "restarted"  # not a state: a restart in place within the running attempt (job.restarted)
FAN_OUT = "notify fan-out"


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


def note_restart(session: Session, job: Job, reason: str) -> None:
    """`job` was restarted in place (service.loops.restarts), in this transaction: `job.restarted`."""
    session.add(
        Notice(
            owner=job.owner,
            job_id=job.id,
            pipeline_id=job.pipeline_id,
            state=RESTARTED,
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


def matching(session: Session, notice: Notice, limit: int) -> list[Subscription]:
    """The next `limit` subscriptions (by id, past the notice's cursor) that may be for the notice:
    bound to its job; bound to its pipeline (its own events and its jobs'); or bound to neither and
    its owner's. Whether each one's `on` covers the state is `wants`."""
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
    query = (
        select(Subscription)
        .where(or_(*ways), col(Subscription.id) > (notice.fanned_to or 0))
        .order_by(col(Subscription.id))
        .limit(limit)
    )
    return list(session.exec(query).all())


def notices_waiting(session: Session) -> bool:
    return session.exec(select(Notice.id).limit(1)).first() is not None


def fan_out(session: Session, dashboard: str, guard: Bulkhead, budget: int) -> int:
    """Fan notices out, looking at no more than `budget` subscriptions in all (a notice with none costs
    one); returns how many notices were worked on (0: none waits). Owners take turns: each owner with
    notices waiting has an equal share of the budget, spent on their oldest notices first, so one
    user's big notices hold another's back by no more than a chunk. Each notice's chunk in a savepoint
    of its own: one that fails stays for the next pass, until the bulkhead gives up on it (then it is
    dropped, with a warning in the log)."""
    oldest = func.min(Notice.id)
    owners = session.exec(
        select(Notice.owner).group_by(col(Notice.owner)).order_by(oldest).limit(budget)
    ).all()
    share = max(1, budget // max(1, len(owners)))
    worked = 0
    for owner in owners:
        query = (
            select(Notice).where(col(Notice.owner) == owner).order_by(col(Notice.id)).limit(share)
            .with_for_update(skip_locked=True)
        )  # fmt: skip
        left = share
        for notice in session.exec(query).all():
            if left <= 0:
                break
            worked += 1
            left -= _fan_out_one(session, notice, dashboard, guard, left)
    session.flush()
    return worked


def _fan_out_one(session: Session, notice: Notice, dashboard: str, guard: Bulkhead, budget: int) -> int:
    """The next chunk of one notice, in a savepoint; returns the budget it spent."""
    assert notice.id is not None
    outcome = guard.guarded(notice.id, _chunk_of(session, notice, dashboard, budget), session)
    if not isinstance(outcome, Fault):
        return max(1, outcome)
    if outcome.gives_up:
        session.delete(notice)
    return 1


def _chunk_of(session: Session, notice: Notice, dashboard: str, budget: int) -> Callable[[], int]:
    """The next chunk of a notice's deliveries; the notice keeps its cursor, or is done and deleted."""

    def work() -> int:
        looked_at = matching(session, notice, budget)
        wanted = [one for one in looked_at if wants(one.on, notice.state)]
        if wanted:
            _add_deliveries(session, notice, wanted, _event(session, notice, dashboard))
        if len(looked_at) < budget:
            session.delete(notice)
        else:
            notice.fanned_to = looked_at[-1].id
            session.add(notice)
        session.flush()
        return len(looked_at)

    return work


def _add_deliveries(
    session: Session, notice: Notice, subscriptions: Sequence[Subscription], payload: dict[str, Any]
) -> None:
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
