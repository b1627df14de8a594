"""Notifications: subscriptions to job and pipeline states (Subscription), the outbox the transitions
door writes in the same transaction as a state change (Notice), and each webhook delivery with its
outcome (Delivery), with the request and public models of the notifications API.

The states a subscription may name are service.states' job states and `ended` (any terminal state);
service.domain.notifications checks them (a 422 names `on.N`)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict
from sqlalchemy import JSON, Column, Index, String, Text
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, time_column, utcnow

DeliveryStatus = Literal["pending", "delivered", "failed"]
MAX_URL = 2000
MAX_ON = 20
ENDED = "ended"  # the alias for every terminal state


class Subscription(SQLModel, table=True):
    """Who is told of what, where: `on` lists states (or `ended`); bound to one job, one pipeline, or
    (neither) every job and pipeline of its owner. `secret` signs each delivery (HMAC-SHA256)."""

    id: int | None = Field(default=None, primary_key=True)
    owner: str = Field(max_length=200, index=True)
    url: str = Field(sa_type=Text)
    secret: str = Field(max_length=200)
    on: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    job_id: int | None = Field(default=None, foreign_key="job.id", index=True)
    pipeline_id: int | None = Field(default=None, foreign_key="pipeline.id", index=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Notice(SQLModel, table=True):
    """The outbox: a job or pipeline reached a state someone may be told of. Written in the
    transaction of the state change; the notify loop turns it into deliveries, a chunk at a time
    (`fanned_to`: the last subscription id looked at), and deletes it with the last chunk."""

    id: int | None = Field(default=None, primary_key=True)
    owner: str = Field(max_length=200)
    job_id: int | None = None
    pipeline_id: int | None = None
    state: str = Field(sa_type=String(20))
    reason: str | None = None
    attempt: int | None = None
    time: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    fanned_to: int | None = None


class Delivery(SQLModel, table=True):
    """One event for one subscription: its body (a snapshot), and how sending it went. `claimed_by`
    and `claimed_until` are a replica's lease while it sends; `delivery_id` is sent as
    X-Torchyard-Delivery, the receiver's key to drop a resend."""

    __table_args__ = (
        Index("ix_delivery_status_next_at", "status", "next_at"),  # the due pending ones
        Index("ix_delivery_owner_id", "owner", "id"),
        Index("ix_delivery_owner_status_next_at", "owner", "status", "next_at"),  # each owner's next
    )

    id: int | None = Field(default=None, primary_key=True)
    delivery_id: str = Field(max_length=36, unique=True)
    subscription_id: int = Field(index=True)  # no foreign key: a removed subscription fails its deliveries
    owner: str = Field(max_length=200)
    url: str = Field(sa_type=Text)
    job_id: int | None = Field(default=None, index=True)
    pipeline_id: int | None = Field(default=None, index=True)
    event: str = Field(max_length=40)
    payload: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    status: str = Field(default="pending", sa_type=String(10))  # DeliveryStatus
    attempts: int = 0
    next_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    last_error: str | None = None
    last_status: int | None = None
    claimed_by: str | None = Field(default=None, max_length=100)
    claimed_until: datetime | None = time_column()
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    delivered_at: datetime | None = time_column()


class NotifySpec(BaseModel):
    """A job spec's `notify` entry: a webhook told when the job reaches one of `on`."""

    model_config = ConfigDict(extra="forbid")

    url: str = pydantic.Field(max_length=MAX_URL, description="An http(s) URL on an allowed host.")
    on: list[str] = pydantic.Field(
        default_factory=lambda: [ENDED],
        min_length=1,
        max_length=MAX_ON,
        description="Job states (failed, succeeded, running, ...) or 'ended' (any ending).",
    )


class SubscriptionCreate(BaseModel):
    """The body of POST /api/v1/notifications/subscriptions."""

    model_config = ConfigDict(extra="forbid")

    url: str = pydantic.Field(max_length=MAX_URL, description="An http(s) URL on an allowed host.")
    on: list[str] = pydantic.Field(
        min_length=1,
        max_length=MAX_ON,
        description="Job states (failed, succeeded, cancelled, timeout, running, retrying, ...) or "
        "'ended' (any ending).",
    )
    job: int | None = pydantic.Field(default=None, ge=1, le=2**63 - 1, description="Only this job.")
    pipeline: int | None = pydantic.Field(
        default=None, ge=1, le=2**63 - 1, description="Only this pipeline (and its jobs)."
    )
    secret: str | None = pydantic.Field(
        default=None,
        min_length=16,
        max_length=200,
        pattern=r"^[\x21-\x7e]+$",
        description="The HMAC key; by default the service makes one (shown on creation).",
    )


class SubscriptionPublic(BaseModel):
    id: int
    owner: str
    url: str
    on: list[str]
    job_id: int | None
    pipeline_id: int | None
    created_at: datetime


class SubscriptionWithSecret(SubscriptionPublic):
    secret: str = pydantic.Field(description="Signs every delivery: X-Torchyard-Signature.")


class DeliveryPublic(BaseModel):
    id: int
    delivery_id: str
    subscription_id: int
    url: str
    job_id: int | None
    pipeline_id: int | None
    event: str
    status: DeliveryStatus
    attempts: int
    next_at: datetime
    last_error: str | None
    last_status: int | None
    created_at: datetime
    delivered_at: datetime | None
    payload: dict[str, Any]
