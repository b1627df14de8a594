"""Sweeps: the request (SweepCreate, its job a JobTemplate), the Sweep table, NewSweep for the intake,
and the public models of a sweep and its trials."""

from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime
from typing import Any, Literal

from pydantic import ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator
from sqlalchemy import JSON, Column, Index
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, utcnow
from service.ledger.models.jobs import JobCreate, NewJob, servable
from service.states import EndingKind, JobState

ParamValue = StrictBool | StrictInt | StrictFloat | StrictStr  # bool first: JSON true is no 1
Goal = Literal["min", "max"]


class JobTemplate(JobCreate):
    """The job of a sweep: a JobCreate without a name (each trial is named after its sweep)."""

    name: None = Field(default=None, description="Leave out: trials are named after the sweep.")  # type: ignore[assignment]


class EarlyStop(SQLModel):
    """Stop a sweep's losing trials early (service.domain.sweep_pruning): at each rung, min_steps x
    reduction_factor^k steps below max_steps, a trial goes on only when its value of the sweep's metric
    is in the top 1/reduction_factor of the trials that reached that rung before it."""

    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    method: Literal["asha", "hyperband"] = Field(
        default="asha", description="'asha' (asynchronous successive halving) or 'hyperband' (its brackets)."
    )
    min_steps: int = Field(ge=1, le=10**9, description="The first rung: steps before any trial is stopped.")
    reduction_factor: int = Field(default=3, ge=2, le=100, description="1/this of a rung's trials go on.")
    max_steps: int = Field(ge=1, le=10**9, description="A whole trial's steps (the last rung is below it).")


class Search(SQLModel):
    """Trials drawn from a space instead of a grid (service.domain.sweep_search): `trials` of them,
    made as earlier ones end, at most max_parallel at once; "tpe" learns from the ended ones' metric.
    Each parameter of `space` is one of {"log_uniform": [low, high]}, {"uniform": [low, high]},
    {"int": [low, high]} (both ends included) or {"choice": [values]}: checked by
    service.domain.sweep_search, naming `search.space.<name>`."""

    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    method: Literal["random", "tpe"] = Field(description="'random', or 'tpe' (Optuna's TPESampler).")
    trials: int = Field(ge=1, le=100_000, description="How many trials in all.")
    seed: int | None = Field(
        default=None, ge=0, le=2**31 - 1,
        description="The samplers' seed; left out, the service picks one and stores it.",
    )  # fmt: skip
    space: dict[str, dict[str, list[ParamValue]]] = Field(
        description="Parameter -> its distribution: log_uniform, uniform, int ([low, high]) or choice."
    )


class SweepCreate(SQLModel):
    """The body of POST /api/v1/sweeps. What pydantic cannot check alone (names, sizes, placeholders)
    service.domain.sweep_trials checks, naming the field."""

    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    name: str = Field(min_length=1, max_length=180, description="The sweep's name; trials are 'name[i]'.")
    job: JobTemplate = Field(description="The job every trial runs, as for POST /jobs but without a name.")
    grid: dict[str, list[ParamValue]] = Field(
        default_factory=dict,
        description="Parameter -> values: every combination is a trial (applied to job.kwargs, or to "
        "job.args through placeholders such as '--lr={lr}' for scripts; '{{' and '}}' are literal braces).",
    )
    zip: dict[str, list[ParamValue]] = Field(
        default_factory=dict,
        description="Parameter -> values of one length, taken together (the i-th of each), times the grid.",
    )
    max_parallel: int | None = Field(
        default=None, ge=1, le=10_000, description="Most trials running at once."
    )
    metric: str = Field(default="loss", min_length=1, max_length=100, description="The metric to compare by.")
    goal: Goal = Field(default="min", description="'min' or 'max': which end of the metric is best.")
    early_stop: EarlyStop | None = Field(
        default=None, description="Stop losing trials at rungs of steps, by the metric they report."
    )
    search: Search | None = Field(
        default=None, description="Draw the trials from a space (random or TPE) instead of grid and zip."
    )

    _servable = field_validator("name", "metric")(servable)


class Sweep(SQLModel, table=True):
    """One sweep: the request that made its trials (each trial is a Job with this sweep_id)."""

    __table_args__ = (
        Index("ix_sweep_owner_idempotency", "owner", "idempotency_key", unique=True),
        Index("ix_sweep_search_trials", "search_trials"),  # the search loop's open sweeps, each tick
    )

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=200)
    owner: str = Field(max_length=200, index=True)
    backend: str = Field(max_length=20)
    request: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))  # the SweepCreate, as JSON
    size: int  # how many trials it made (a search makes more as earlier ones end)
    search_trials: int | None = None  # a search's trials in all; the loop makes them until size is this
    max_parallel: int | None = None
    metric: str = Field(max_length=100)
    goal: str = Field(max_length=3)
    idempotency_key: str | None = Field(default=None, max_length=200)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


@dataclass(frozen=True)
class NewSweep:
    """A sweep as admitted, before it is stored: its row's values and its trials' jobs."""

    name: str
    owner: str
    backend: str
    request: dict[str, Any]
    max_parallel: int | None
    metric: str
    goal: str
    trials: list[NewJob]
    idempotency_key: str | None = None
    search_trials: int | None = None  # a search's trials in all (its first wave is `trials`)
    created_at: datetime = dataclass_field(default_factory=utcnow)


class TrialPublic(SQLModel):
    job_id: int
    name: str
    params: dict[str, Any]
    state: JobState
    reason: str | None
    metric_last: float | None = Field(description="The sweep's metric as the trial last reported it.")
    metric_best: float | None = Field(description="Its best value so far (by the sweep's goal).")
    steps: int | None = Field(
        default=None, description="The last step it reported the metric at: how far it ran."
    )
    ending: EndingKind | None = Field(
        default=None, description="Why it ended, once it has: 'pruned' for a trial early_stop stopped."
    )


class SweepCompute(SQLModel):
    """What early_stop saved: steps run against a full run (early_stop.max_steps) of every trial."""

    steps_run: int = Field(description="Steps the trials ran, by the last step each reported.")
    steps_full: int = Field(description="max_steps times the number of trials.")
    saved: float = Field(description="1 - steps_run / steps_full (trials yet to run count as saved).")


class SweepPublic(SQLModel):
    id: int
    name: str
    owner: str
    backend: str
    size: int = Field(description="How many trials it has.")
    max_parallel: int | None
    metric: str
    goal: Goal
    grid: dict[str, list[Any]]
    zip: dict[str, list[Any]]
    job: dict[str, Any] = Field(description="The job every trial runs, before its parameters.")
    created_at: datetime
    state: Literal["active", "finished"] = Field(description="'active' while any trial has not ended.")
    counts: dict[JobState, int] = Field(description="Its trials by state.")
    best: TrialPublic | None = Field(description="The trial whose last value of the metric is best.")
    early_stop: EarlyStop | None = Field(default=None, description="As the request gave it.")
    search: Search | None = Field(default=None, description="As the request gave it (its seed filled in).")
    compute: SweepCompute | None = Field(default=None, description="With early_stop: the steps it saved.")
    trials: list[TrialPublic] = Field(description="Every trial, in order (empty in lists).")


class SweepPage(SQLModel):
    items: list[SweepPublic]
    next_cursor: str | None = None
