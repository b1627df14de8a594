"""A job's goodput as readers see it: its wall time split into training, restart downtime, recomputed
work and queue wait (service.domain.goodput works it out; the job row keeps the last one)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

GoodputPart = Literal["training", "downtime", "recomputed", "queue"]
GOODPUT_PARTS: tuple[GoodputPart, ...] = ("training", "downtime", "recomputed", "queue")


class Goodput(BaseModel):
    """Seconds of the job's wall time in each part, as of `as_of`; `accruing` is the part the time
    since then goes to (None once the job ended), so a reader may add it up to now."""

    training_s: float = Field(0.0, description="Training that was kept: running, less the parts below.")
    downtime_s: float = Field(
        0.0, description="Restarts in place: from a rank's loss to the first step after the restart."
    )
    recomputed_s: float = Field(
        0.0, description="Work lost with a rank and done again: trained since the checkpoint resumed from."
    )
    queue_s: float = Field(0.0, description="Queued, pending in the scheduler, retrying or requeued.")
    ratio: float | None = Field(None, description="training_s over the wall time counted (None: none yet).")
    as_of: datetime | None = Field(None, description="When these were worked out.")
    accruing: GoodputPart | None = Field(None, description="Where the time since `as_of` goes.")
