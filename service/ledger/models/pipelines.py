"""Dependencies between jobs (JobDependency: a job runs after others) and pipelines (Pipeline, its
named stages PipelineStage, each a job or a sweep), with the request models that name them."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict
from sqlalchemy import JSON, Column, Index, String
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, time_column, utcnow

if TYPE_CHECKING:  # jobs.py and sweeps.py import this module
    from service.ledger.models.jobs import NewJob
    from service.ledger.models.sweeps import NewSweep

DependsOn = Literal["succeeded", "ended", "failed"]
DEPENDS_ON: tuple[DependsOn, ...] = ("succeeded", "ended", "failed")
MAX_AFTER = 100  # dependencies of one job


class Dependency(BaseModel):
    """One job this one runs after, and how that job must end for this one to run."""

    model_config = ConfigDict(extra="forbid")

    job: int = pydantic.Field(ge=1, le=2**63 - 1, description="The id of a job you may see.")
    on: DependsOn = pydantic.Field(
        default="succeeded",
        description="'succeeded' (the default), 'failed' (it failed or timed out) or 'ended' (however "
        "it ended). Only its final outcome counts: its retries are waited out.",
    )


class JobDependency(SQLModel, table=True):
    """`job_id` runs after `upstream_id` has ended as `on` says (service.domain.dependencies)."""

    __table_args__ = (Index("ix_jobdependency_upstream", "upstream_id"),)

    job_id: int = Field(foreign_key="job.id", primary_key=True)
    upstream_id: int = Field(foreign_key="job.id", primary_key=True)
    on: str = Field(default="succeeded", sa_type=String(10))  # DependsOn
    position: int = 0  # its place in the job's `after` (a 4xx names after.<position>)


class Pipeline(SQLModel, table=True):
    """One pipeline: named stages, each a job or a sweep, run after one another as their `after` says.

    Its state is its stages' (service.domain.pipelines decides it as its jobs end, in the same
    transaction): running while any stage has not ended, then succeeded, failed or cancelled."""

    __table_args__ = (Index("ix_pipeline_owner_idempotency", "owner", "idempotency_key", unique=True),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=200)
    owner: str = Field(max_length=200, index=True)
    request: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))  # the PipelineCreate, as JSON
    state: str = Field(default="running", sa_type=String(20))
    reason: str | None = None
    idempotency_key: str | None = Field(default=None, max_length=200)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    finished_at: datetime | None = time_column()


class PipelineStage(SQLModel, table=True):
    """A stage of a pipeline: the job or sweep that runs it now (a `retry --from` makes new ones;
    the earlier ones stay, with their pipeline_id, as its history)."""

    pipeline_id: int = Field(foreign_key="pipeline.id", primary_key=True)
    name: str = Field(max_length=100, primary_key=True)
    position: int  # the order stages were given in
    after: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))  # stage names
    on: str = Field(default="succeeded", sa_type=String(10))  # DependsOn, for every stage in `after`
    job_id: int | None = Field(default=None, foreign_key="job.id")
    sweep_id: int | None = Field(default=None, foreign_key="sweep.id")
    runs: int = 1  # how many times it was made (1 + its retries --from)


class StageCreate(BaseModel):
    """One stage of a pipeline: a job or a sweep (exactly one), run after the stages it names."""

    model_config = ConfigDict(extra="forbid")

    name: str = pydantic.Field(
        min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.\-]+$", description="The stage's name."
    )
    job: dict[str, Any] | None = pydantic.Field(
        default=None, description="A job spec, as for POST /api/v1/jobs (its `name` defaults to the stage's)."
    )
    sweep: dict[str, Any] | None = pydantic.Field(
        default=None, description="A sweep, as for POST /api/v1/sweeps (its `name` defaults to the stage's)."
    )
    after: list[str] = pydantic.Field(
        default_factory=list, max_length=MAX_AFTER, description="Stages (by name) this one runs after."
    )
    on: DependsOn = pydantic.Field(
        default="succeeded", description="How each stage in `after` must end: succeeded, failed or ended."
    )


class PipelineCreate(BaseModel):
    """The body of POST /api/v1/pipelines (and of `torchyard submit pipeline.yaml`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = pydantic.Field(min_length=1, max_length=200, description="The pipeline's name.")
    stages: list[StageCreate] = pydantic.Field(min_length=1, max_length=50, description="Its stages.")


StageKind = Literal["job", "sweep"]
PipelineState = Literal["running", "succeeded", "failed", "cancelled"]


class StagePublic(BaseModel):
    name: str
    position: int
    kind: StageKind
    after: list[str] = pydantic.Field(description="The stages it runs after.")
    on: DependsOn
    job_id: int | None = pydantic.Field(description="Its job now (a job stage).")
    sweep_id: int | None = pydantic.Field(description="Its sweep now (a sweep stage).")
    state: str = pydantic.Field(description="A job stage: its job's state; a sweep stage: 'active' or the "
                                "state its trials came to (succeeded when all did).")  # fmt: skip
    reason: str | None
    runs: int = pydantic.Field(
        description="How often it was made: 1, plus each `retry --from` that reran it."
    )


class PipelinePublic(BaseModel):
    id: int
    name: str
    owner: str
    state: PipelineState
    reason: str | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    stages: list[StagePublic]


class PipelinePage(BaseModel):
    items: list[PipelinePublic]
    next_cursor: str | None = None


@dataclass(frozen=True)
class NewStage:
    """A stage as admitted, before it is stored: its job or its sweep (with every trial), and the
    stages it runs after (their jobs' ids are known only as the store inserts them, in order)."""

    name: str
    position: int
    after: tuple[str, ...]
    on: str
    job: NewJob | None = None
    sweep: NewSweep | None = None


@dataclass(frozen=True)
class NewPipeline:
    """A pipeline as admitted: its row's values and its stages, upstream before downstream."""

    name: str
    owner: str
    request: dict[str, Any]
    stages: list[NewStage]
    idempotency_key: str | None = None
    created_at: datetime = dataclass_field(default_factory=utcnow)


@dataclass(frozen=True)
class PipelineAccepted:
    """What the store made of a pipeline: its id, and whether an Idempotency-Key retry found it."""

    pipeline_id: int
    replayed: bool
