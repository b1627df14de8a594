"""Webhook deliveries on their way: claimed fairly by the replica that sends them, settled by it, and
pruned once kept long enough. The caller owns the transaction. (Made by service.domain.outbox's
fan-out; sent by service.loops.notify.)

Two replicas never send one delivery together: a delivery is sent only under a lease
(`claimed_by`, `claimed_until`) taken by a conditional UPDATE that only one writer can win, and
settled only by the lease's holder. A replica killed mid-send leaves a lease that expires; the resend
carries the same delivery id, which the receiver may use to drop it.

Fair share: claims go round-robin by owner (each owner's oldest due delivery first, then each one's
next, ...), and no owner has more than `per_owner` deliveries in flight across all replicas. So one
user's thousands of deliveries to a slow receiver hold a few senders, never everyone's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, func, or_, update
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import Session, col, select

from service.ledger.models.columns import utcnow
from service.ledger.models.notifications import Delivery, Subscription

MAX_ERROR = 500
PRUNE_CHUNK = 1000


@dataclass(frozen=True)
class Claimed:
    """A delivery this replica holds the lease of, with what sending it needs."""

    id: int
    delivery_id: str
    owner: str
    url: str
    event: str
    payload: dict[str, Any]
    attempts: int  # this try included
    secret: str | None  # None: its subscription was removed


@dataclass(frozen=True)
class Outcome:
    """How one try went: `delivered`, or why not (`error`; `permanent`: trying again cannot help)."""

    delivered: bool
    status: int | None = None
    error: str | None = None
    permanent: bool = False


def _due(now: datetime) -> ColumnElement[bool]:
    return and_(
        col(Delivery.status) == "pending",
        col(Delivery.next_at) <= now,
        or_(col(Delivery.claimed_until).is_(None), col(Delivery.claimed_until) < now),
    )


def any_due(session: Session) -> bool:
    return session.exec(select(Delivery.id).where(_due(utcnow())).limit(1)).first() is not None


def claim_fairly(session: Session, me: str, lease_s: float, slots: int, per_owner: int) -> list[Claimed]:
    """Take the lease of up to `slots` due deliveries, round-robin by owner, none past `per_owner` in
    flight (each try counted as it is taken: a replica that dies sending it has spent it). Commit
    before sending."""
    now = utcnow()
    queues = _owners_next(session, now, slots, per_owner)
    picked: list[int] = []
    while queues and len(picked) < slots:
        for owner in list(queues):
            picked.append(queues[owner].popleft())
            if not queues[owner]:
                del queues[owner]
            if len(picked) == slots:
                break
    until = now + timedelta(seconds=lease_s)
    taken = [one for one in picked if _lease(session, one, me, now, until)]
    if not taken:
        return []
    rows = session.exec(
        select(Delivery, Subscription.secret)
        .join(Subscription, col(Subscription.id) == col(Delivery.subscription_id), isouter=True)
        .where(col(Delivery.id).in_(taken))
        .order_by(col(Delivery.id))
        .execution_options(populate_existing=True)
    ).all()
    by_id = {row.id: (row, secret) for row, secret in rows}
    return [_claimed(*by_id[one]) for one in taken]


def _owners_next(session: Session, now: datetime, slots: int, per_owner: int) -> dict[str, deque[int]]:
    """For up to `slots` owners with room, oldest due first: the ids of their next due deliveries."""
    busy = dict(
        session.exec(
            select(Delivery.owner, func.count())
            .where(col(Delivery.status) == "pending", col(Delivery.claimed_until) >= now)
            .group_by(col(Delivery.owner))
        ).all()
    )
    oldest = func.min(Delivery.next_at)
    waiting = session.exec(
        select(Delivery.owner, oldest).where(_due(now)).group_by(col(Delivery.owner)).order_by(oldest)
    ).all()
    queues: dict[str, deque[int]] = {}
    for owner, _ in waiting:
        room = min(slots, per_owner - busy.get(owner, 0))
        if room <= 0:
            continue
        query = (
            select(Delivery.id)
            .where(_due(now), col(Delivery.owner) == owner)
            .order_by(col(Delivery.next_at), col(Delivery.id))
            .limit(room)
        )
        queues[owner] = deque(one for one in session.exec(query).all() if one is not None)
        if len(queues) == slots:
            break
    return {owner: ids for owner, ids in queues.items() if ids}


def _lease(session: Session, delivery_id: int, me: str, now: datetime, until: datetime) -> bool:
    """The conditional UPDATE only one replica wins (on PostgreSQL the loser's WHERE is read again
    after the winner commits, and no longer holds)."""
    changed = session.connection().execute(
        update(Delivery)
        .where(col(Delivery.id) == delivery_id, _due(now))
        .values(claimed_by=me, claimed_until=until, attempts=col(Delivery.attempts) + 1)
    )
    return bool(changed.rowcount == 1)


def _claimed(row: Delivery, secret: str | None) -> Claimed:
    return Claimed(
        row.id or 0, row.delivery_id, row.owner, row.url, row.event, row.payload, row.attempts, secret
    )


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


def prune(session: Session, keep_days: float, limit: int = PRUNE_CHUNK) -> int:
    """Delete up to `limit` delivered or failed deliveries made more than `keep_days` ago (pending
    ones stay, whatever their age); returns how many. A chunk a transaction: call again while it
    returns `limit`."""
    cutoff = utcnow() - timedelta(days=keep_days)
    old = (
        select(Delivery.id)
        .where(col(Delivery.status).in_(("delivered", "failed")), col(Delivery.created_at) < cutoff)
        .limit(limit)
    )
    ids = [one for one in session.exec(old).all() if one is not None]
    if ids:
        session.connection().execute(delete(Delivery).where(col(Delivery.id).in_(ids)))
    return len(ids)
