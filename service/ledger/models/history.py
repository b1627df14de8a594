"""A job's history: the clock every change is stamped by, each state change (JobEvent) and how each
attempt ended (JobAttempt), with their public models."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, Column, Index, String
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, time_column, utcnow
from service.states import EndingKind, JobState
from worker.spec import RankPlacement


class LedgerClock(SQLModel, table=True):
    """One row, bumped at commit by every transaction that changes a job (service.ledger.clock)."""

    id: int = Field(default=1, primary_key=True)
    seq: int = Field(default=0, sa_type=BigInteger)  # one per commit: 32 bits run out on a busy cluster
    stamped_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class JobEvent(SQLModel, table=True):
    """One state change of one job."""

    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(foreign_key="job.id", index=True)
    from_state: JobState | None = Field(default=None, sa_type=String(20))
    to_state: JobState = Field(sa_type=String(20))
    reason: str | None = None
    attempt: int = 1
    time: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class JobEventPublic(SQLModel):
    id: int
    job_id: int
    from_state: JobState | None
    to_state: JobState
    reason: str | None
    attempt: int
    time: datetime


class JobAttempt(SQLModel, table=True):
    """How one attempt of a job ended: written once, when it ended (unique per job and attempt)."""

    __table_args__ = (Index("ix_jobattempt_job_attempt", "job_id", "attempt", unique=True),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(foreign_key="job.id")
    attempt: int
    state: JobState = Field(sa_type=String(20))  # how it ended: failed, timeout, succeeded, ...
    kind: str | None = Field(default=None, max_length=20)  # EndingKind: why, for retry policies
    reason: str | None = None
    exit_code: int | None = None
    external_id: str | None = Field(default=None, max_length=64)
    nodes: str | None = None
    placement: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    started_at: datetime | None = time_column()
    ended_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class JobAttemptPublic(SQLModel):
    attempt: int
    state: JobState = Field(description="How the attempt ended; the job's state for the current one.")
    kind: EndingKind | None = Field(description="Why it ended, as retry policies name it.")
    reason: str | None
    exit_code: int | None
    external_id: str | None = Field(description="The backend's id of this attempt.")
    nodes: str | None = Field(description="The hosts it ran on.")
    placement: list[RankPlacement] | None = Field(description="Where each of its ranks ran.")
    started_at: datetime | None = Field(description="When its ranks started.")
    ended_at: datetime | None = Field(description="None for the current attempt.")
