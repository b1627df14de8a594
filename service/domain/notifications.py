"""Webhook subscriptions and their deliveries, as their owner makes and reads them (the routes in
service/api/routes/notifications.py, and a job spec's `notify`). The outbox and the sending are
service.domain.outbox and service.loops.notify; which URLs are allowed, service.domain.webhook_hosts.

Subscriptions and deliveries are their owner's alone: another user's id answers 404, for admins too
(a subscription holds its owner's secret). A URL is checked (its host resolved) before any
transaction opens: DNS is a call out.

Counts are capped (409 naming the limit): subscriptions of one user not bound to a job (each of
those is told of every matching notice of the owner's: they multiply the fan-out), and
subscriptions bound to one job. `on` names only states a notice is written for.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from sqlalchemy import func, update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.config import Settings
from service.domain import audit, jobs, webhook_hosts
from service.domain.auth import Principal
from service.domain.outbox import NOTIFIABLE, RESTARTED
from service.errors import Conflict, InvalidRequest, NotFound
from service.ledger.db import session_scope
from service.ledger.models.notifications import (
    ENDED,
    Delivery,
    DeliveryPublic,
    DeliveryStatus,
    NotifySpec,
    Subscription,
    SubscriptionCreate,
    SubscriptionPublic,
    SubscriptionWithSecret,
)
from service.ledger.models.pipelines import Pipeline
from service.states import JobState

# Only states a notice is written for: a subscription to `queued` would never be told anything.
# And `restarted`: no state, a restart in place of a running attempt (service.loops.restarts).
STATE_NAMES: frozenset[str] = frozenset(state.value for state in NOTIFIABLE) | {ENDED, RESTARTED}
NEVER_TOLD: frozenset[str] = frozenset(state.value for state in JobState) - STATE_NAMES
MAX_PAGE = 500
REMOVED = "its subscription was removed"


def rules_of(settings: Settings) -> webhook_hosts.HostRules:
    return webhook_hosts.HostRules.of(
        settings.webhook_hosts, settings.webhook_private_hosts, settings.webhook_ports
    )


def check_on(on: Sequence[str], field: str = "on") -> list[str]:
    """The states, each known (a 422 names `on.N`), once each, in the order given."""
    for position, name in enumerate(on):
        if name not in STATE_NAMES:
            known = ", ".join(sorted(STATE_NAMES))
            what = "is never told" if name in NEVER_TOLD else "is not a state"
            raise InvalidRequest(f"{name!r} {what} (one of: {known})", field=f"{field}.{position}")
    return list(dict.fromkeys(on))


def check_url(url: str, settings: Settings, field: str = "url") -> None:
    """The URL against the operator's host lists, its host resolved now (422 naming `field`)."""
    try:
        webhook_hosts.check_url(url, rules_of(settings))
    except webhook_hosts.Refused as refused:
        raise InvalidRequest(str(refused), field=field) from None


def check_notify(notify: Sequence[NotifySpec], settings: Settings) -> None:
    """A job spec's `notify`, at admission (off the event loop: it resolves hosts)."""
    most = settings.max_subscriptions_per_job
    if len(notify) > most:
        raise Conflict(
            f"{len(notify)} webhooks for one job; the most is {most} (TORCHYARD_MAX_SUBSCRIPTIONS_PER_JOB)",
            field="notify",
        )
    for position, one in enumerate(notify):
        check_on(one.on, f"notify.{position}.on")
        check_url(one.url, settings, f"notify.{position}.url")


def subscribe(
    engine: Engine, settings: Settings, user: Principal, body: SubscriptionCreate
) -> SubscriptionWithSecret:
    """A new subscription of `user`'s, with its secret (made unless given)."""
    on = check_on(body.on)
    if body.job is not None and body.pipeline is not None:
        raise InvalidRequest("name a job or a pipeline, not both", field="pipeline")
    check_url(body.url, settings)
    with session_scope(engine) as session:
        if body.job is not None:
            try:
                jobs.get_job(session, body.job, user)
            except NotFound as missing:
                raise NotFound(missing.message, field="job") from None
        if body.pipeline is not None:
            pipeline = session.get(Pipeline, body.pipeline)
            if pipeline is None or not user.may_see(pipeline.owner):
                raise NotFound(f"pipeline {body.pipeline} not found", field="pipeline")
        _check_room(session, settings, user, body.job)
        row = Subscription(
            owner=user.user,
            url=body.url,
            secret=body.secret or secrets.token_hex(32),
            on=on,
            job_id=body.job,
            pipeline_id=body.pipeline,
        )
        session.add(row)
        session.flush()
        audit.record(session, user.user, "notify.subscribe", f"subscription {row.id}", f"url={body.url}")
        return SubscriptionWithSecret.model_validate(row, from_attributes=True)


def _check_room(session: Session, settings: Settings, user: Principal, job: int | None) -> None:
    """409 when the user (or the job) has as many subscriptions as it may."""
    count = select(func.count()).select_from(Subscription)
    if job is not None:
        have = session.exec(count.where(col(Subscription.job_id) == job)).one()
        most, setting, whose = settings.max_subscriptions_per_job, "MAX_SUBSCRIPTIONS_PER_JOB", f"job {job}"
    else:
        mine = count.where(col(Subscription.owner) == user.user, col(Subscription.job_id).is_(None))
        have = session.exec(mine).one()
        most, setting, whose = settings.max_subscriptions_per_user, "MAX_SUBSCRIPTIONS_PER_USER", "you"
    if have >= most:
        raise Conflict(
            f"{whose} already {'has' if job is not None else 'have'} {have} subscriptions, the most allowed "
            f"(TORCHYARD_{setting}={most}); remove one first",
            field="job" if job is not None else None,
        )


def list_subscriptions(session: Session, user: Principal) -> list[SubscriptionPublic]:
    query = select(Subscription).where(col(Subscription.owner) == user.user).order_by(col(Subscription.id))
    return [SubscriptionPublic.model_validate(one, from_attributes=True) for one in session.exec(query)]


def get_subscription(session: Session, subscription_id: int, user: Principal) -> SubscriptionWithSecret:
    return SubscriptionWithSecret.model_validate(_own(session, subscription_id, user), from_attributes=True)


def remove_subscription(session: Session, subscription_id: int, user: Principal) -> SubscriptionPublic:
    """Gone, and its deliveries not yet sent fail (a send under way settles as it goes)."""
    row = _own(session, subscription_id, user)
    removed = SubscriptionPublic.model_validate(row, from_attributes=True)
    session.connection().execute(
        update(Delivery)
        .where(col(Delivery.subscription_id) == subscription_id, col(Delivery.status) == "pending")
        .values(status="failed", last_error=REMOVED)
    )
    session.delete(row)
    audit.record(session, user.user, "notify.unsubscribe", f"subscription {subscription_id}")
    return removed


def list_deliveries(
    session: Session,
    user: Principal,
    *,
    job: int | None = None,
    pipeline: int | None = None,
    status: DeliveryStatus | None = None,
    limit: int = 100,
) -> list[DeliveryPublic]:
    """The caller's deliveries, newest first; of a job or pipeline they may see (404 otherwise)."""
    query = select(Delivery).where(col(Delivery.owner) == user.user)
    if job is not None:
        try:
            jobs.get_job(session, job, user)
        except NotFound as missing:
            raise NotFound(missing.message, field="job") from None
        query = query.where(col(Delivery.job_id) == job)
    if pipeline is not None:
        found = session.get(Pipeline, pipeline)
        if found is None or not user.may_see(found.owner):
            raise NotFound(f"pipeline {pipeline} not found", field="pipeline")
        query = query.where(col(Delivery.pipeline_id) == pipeline)
    if status is not None:
        query = query.where(col(Delivery.status) == status)
    query = query.order_by(col(Delivery.id).desc()).limit(max(1, min(limit, MAX_PAGE)))
    return [DeliveryPublic.model_validate(one, from_attributes=True) for one in session.exec(query)]


def subscribe_new_jobs(session: Session, made: Sequence[tuple[int, str, Sequence[NotifySpec]]]) -> None:
    """Subscriptions bound to new jobs from their specs' `notify` (job id, owner, entries), in the
    intake's transaction. Each takes the secret of its owner's earlier subscription to the same URL,
    so that a receiver checks one secret; else a new one (GET the subscription to read it)."""
    wanted = [(job_id, owner, one) for job_id, owner, entries in made for one in entries]
    if not wanted:
        return
    owners = {owner for _, owner, _ in wanted}
    urls = {one.url for _, _, one in wanted}
    known: dict[tuple[str, str], str] = {}
    earlier = select(Subscription.owner, Subscription.url, Subscription.secret).where(
        col(Subscription.owner).in_(owners), col(Subscription.url).in_(urls)
    )
    for owner, url, secret in session.exec(earlier.order_by(col(Subscription.id))):
        known.setdefault((owner, url), secret)
    for job_id, owner, one in wanted:
        secret = known.setdefault((owner, one.url), secrets.token_hex(32))
        on = list(dict.fromkeys(one.on))  # checked at admission (a retry carries what was admitted then)
        session.add(Subscription(owner=owner, url=one.url, secret=secret, on=on, job_id=job_id))
    session.flush()


def notify_entries(spec: Sequence[dict[str, Any]] | None) -> tuple[NotifySpec, ...]:
    return tuple(NotifySpec.model_validate(one) for one in spec or ())


def _own(session: Session, subscription_id: int, user: Principal) -> Subscription:
    row = session.get(Subscription, subscription_id)
    if row is None or row.owner != user.user:
        raise NotFound(f"subscription {subscription_id} not found", field="subscription_id")
    return row
