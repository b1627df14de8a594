"""/api/v1/notifications: webhook subscriptions and their deliveries, thin routes over
service.domain.notifications (the sending is service.loops.notify's)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query

from service.api.deps import CurrentUser, RuntimeDep, SessionDep
from service.api.errors import error_responses
from service.domain import notifications
from service.domain.cursors import MAX_ID
from service.ledger.models.notifications import (
    DeliveryPublic,
    DeliveryStatus,
    SubscriptionCreate,
    SubscriptionPublic,
    SubscriptionWithSecret,
)

router = APIRouter(prefix="/api/v1/notifications", tags=["notifications"])

SubscriptionId = Annotated[int, Path(ge=1, le=MAX_ID, description="The subscription's id.")]


@router.post(
    "/subscriptions",
    status_code=201,
    response_model=SubscriptionWithSecret,
    summary="Subscribe a webhook to job or pipeline states",
    responses=error_responses(404, 409, 422),
)
def subscribe(body: SubscriptionCreate, runtime: RuntimeDep, user: CurrentUser) -> SubscriptionWithSecret:
    """The URL's host must be allowed by the operator (TORCHYARD_WEBHOOK_HOSTS), and resolve to public
    addresses unless TORCHYARD_WEBHOOK_PRIVATE_HOSTS names it; its port must be allowed
    (TORCHYARD_WEBHOOK_PORTS, by default 80 and 443). 409: the user (or the job) has as many
    subscriptions as it may. The answer holds the secret that signs
    every delivery (X-Torchyard-Signature: sha256=<HMAC-SHA256 of the body>)."""
    return notifications.subscribe(runtime.engine, runtime.settings, user, body)


@router.get(
    "/subscriptions",
    response_model=list[SubscriptionPublic],
    summary="Your subscriptions",
    responses=error_responses(422),
)
def list_subscriptions(session: SessionDep, user: CurrentUser) -> list[SubscriptionPublic]:
    return notifications.list_subscriptions(session, user)


@router.get(
    "/subscriptions/{subscription_id}",
    response_model=SubscriptionWithSecret,
    summary="One of your subscriptions, with its secret",
    responses=error_responses(404, 422),
)
def get_subscription(
    subscription_id: SubscriptionId, session: SessionDep, user: CurrentUser
) -> SubscriptionWithSecret:
    return notifications.get_subscription(session, subscription_id, user)


@router.delete(
    "/subscriptions/{subscription_id}",
    response_model=SubscriptionPublic,
    summary="Remove a subscription (its deliveries not yet sent fail); answers what was removed",
    responses=error_responses(404, 422),
)
def remove_subscription(
    subscription_id: SubscriptionId, session: SessionDep, user: CurrentUser
) -> SubscriptionPublic:
    return notifications.remove_subscription(session, subscription_id, user)


@router.get(
    "/deliveries",
    response_model=list[DeliveryPublic],
    summary="Your webhook deliveries, newest first: status, attempts, last error",
    responses=error_responses(404, 422),
)
def list_deliveries(
    session: SessionDep,
    user: CurrentUser,
    job: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Of this job.")] = None,
    pipeline: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Of this pipeline.")] = None,
    status: Annotated[DeliveryStatus | None, Query(description="pending, delivered or failed.")] = None,
    limit: Annotated[int, Query(ge=1, le=notifications.MAX_PAGE)] = 100,
) -> list[DeliveryPublic]:
    return notifications.list_deliveries(
        session, user, job=job, pipeline=pipeline, status=status, limit=limit
    )
