"""Stack captures: the last capture of every rank's stacks, one row per job and attempt
(service.domain.capture writes it), with the public models the stacks route answers."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel
from sqlalchemy import JSON, Column, Index, String
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, utcnow

Trigger = Literal["request", "stall", "ending"]
TRIGGERS: tuple[Trigger, ...] = ("request", "stall", "ending")


class StackCapture(SQLModel, table=True):
    """The last capture of one attempt of one job (a later capture of the same attempt replaces it).

    `ranks` and `groups` are the StackRankPublic and StackGroupPublic lists as JSON: what the ranks
    wrote, already parsed bounded and cleaned (service.domain.stacks)."""

    __table_args__ = (Index("ix_stackcapture_job_attempt", "job_id", "attempt", unique=True),)

    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(foreign_key="job.id")
    attempt: int
    captured_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    trigger: str = Field(sa_type=String(20))  # Trigger
    took_s: float = 0.0  # from the signal to the last rank's stacks read
    summary: str = ""
    ranks: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    groups: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))


class StackFramePublic(BaseModel):
    file: str
    line: int
    function: str


class StackThreadPublic(BaseModel):
    name: str = Field(description="The thread's id as faulthandler prints it.")
    current: bool = Field(description="The thread the signal interrupted (the main thread, mostly).")
    frames: list[StackFramePublic] = Field(description="Innermost first, as Python prints them.")
    truncated: bool = Field(False, description="More frames than were kept.")


class StackRankPublic(BaseModel):
    rank: int
    host: str | None = Field(description="Where the rank runs (its placement).")
    threads: list[StackThreadPublic]
    note: str | None = Field(description="What went wrong reading this rank's stacks, if anything.")


class StackGroupPublic(BaseModel):
    ranks: list[int] = Field(description="Ranks whose main thread had the same stack.")
    label: str = Field(description='The ranks as people read them: "0, 2-7".')
    threads: list[StackThreadPublic] = Field(description="The stacks of the group's first rank.")
    note: str | None = Field(None, description="The first rank's note.")


class StackCapturePublic(BaseModel):
    job_id: int
    attempt: int
    captured_at: datetime
    trigger: Trigger
    took_s: float = Field(description="Seconds from the signal to the last rank's stacks read.")
    summary: str = Field(description='"rank 1 on n2 in train.py:41 next_batch; ranks 0, 2 wait in ..."')
    groups: list[StackGroupPublic] = Field(description="Ranks with the same stack, the odd ones first.")
    ranks: list[StackRankPublic]
    fresh: bool = Field(False, description="Captured by this request (else the attempt's last capture).")
