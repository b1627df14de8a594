"""Metrics: every reported value (JobMetric), its rollup by zoom level (JobMetricRollup), and the
series a reader is served."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Index
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, utcnow


class JobMetric(SQLModel, table=True):
    """One reported value: (step, name, value) as rank 0 wrote it."""

    __table_args__ = (
        Index("ix_jobmetric_job_step", "job_id", "step"),
        Index("ix_jobmetric_series", "job_id", "name", "attempt", "step"),  # one series, by step
    )

    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(foreign_key="job.id")
    step: int
    name: str = Field(max_length=100)
    value: float
    attempt: int = 1
    time: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class JobMetricPublic(SQLModel):
    step: int
    name: str
    value: float
    attempt: int
    time: datetime


class JobMetricRollup(SQLModel, table=True):
    """One bucket of one series (a metric of one attempt) at one zoom level: its first, last, lowest
    and highest point. Level k buckets span 8**k steps (service.domain.metric_series)."""

    __table_args__ = (
        Index("ix_jobmetricrollup_bucket", "job_id", "level", "name", "attempt", "bucket", unique=True),
    )

    id: int | None = Field(default=None, primary_key=True)
    job_id: int = Field(foreign_key="job.id")
    level: int
    name: str = Field(max_length=100)
    attempt: int
    bucket: int  # first step // 8**level
    count: int
    first_step: int
    first_value: float
    last_step: int
    last_value: float
    min_step: int
    min_value: float
    max_step: int
    max_value: float


class MetricSeries(SQLModel):
    name: str
    attempt: int
    steps: list[int]
    values: list[float]
    downsampled: bool = Field(
        description="True when the points are each bucket's first, lowest, highest and last point "
        "rather than every reported one."
    )


class MetricSeriesPage(SQLModel):
    """GET /jobs/{id}/metrics?points=N: every series in at most N points, spikes kept."""

    points: int = Field(description="The most points per series that were asked for.")
    from_step: int | None
    to_step: int | None
    series: list[MetricSeries]
