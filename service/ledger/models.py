"""Ledger tables and their API model families (JobCreate -> Job -> JobPublic ...)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime, timezone
from typing import Any, Literal

import pydantic
from pydantic import (
    BaseModel,
    ConfigDict,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from sqlalchemy import JSON, BigInteger, Column, DateTime, Index, String, TypeDecorator
from sqlalchemy.engine import Dialect
from sqlmodel import Field, SQLModel

from service.states import EndingKind, JobState
from worker.spec import (
    CODE_ID_PATTERN,
    CheckpointPolicy,
    RankPlacement,
    Resources,
    check_entrypoint,
    check_one_target,
    json_problem,
)

MAX_SPEC_VALUES_BYTES = 256 * 1024  # kwargs, args and env of one job, as JSON


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator[datetime]):
    """Store UTC, always hand back timezone-aware datetimes (SQLite forgets the zone)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


def _time_column(nullable: bool = True, index: bool = False) -> Any:
    return Field(default=None, sa_type=UTCDateTime, nullable=nullable, index=index)


# ---------------------------------------------------------------- jobs


def servable(value: Any, info: ValidationInfo) -> Any:
    """A field validator: nothing a response or the ledger cannot hold. A lone surrogate or a NaN
    parses, and the row would then break every list it is in; NUL fits neither PostgreSQL nor a
    process's argv (and, on PostgreSQL, fails the intake's whole group commit, not only its own row)."""
    if (problem := json_problem(value)) is not None:
        path, why = problem
        where = f"{info.field_name}.{path}" if path else info.field_name
        raise ValueError(f"{where} {why}")
    return value


class JobBase(SQLModel):
    name: str = Field(min_length=1, max_length=200, description="A name to find the job by.")


RetryOn = Literal["failure", "node_failure", "preemption", "timeout", "oom"]
MAX_RETRY_WAIT_S = 24 * 3600.0
DEFAULT_RETRY_ON: tuple[RetryOn, ...] = ("node_failure", "preemption")  # not the user's own failures


class RetryPolicy(BaseModel):
    """When an attempt that ended for one of `on` is followed by another, and after how long."""

    model_config = ConfigDict(extra="forbid")

    max: int = pydantic.Field(2, ge=0, le=20, description="Most attempts after the first.")
    backoff_s: float = pydantic.Field(30.0, ge=0, le=MAX_RETRY_WAIT_S, description="Wait before retry 1.")
    backoff_factor: float = pydantic.Field(2.0, ge=1, le=10, description="Growth of each next wait.")
    on: list[RetryOn] = pydantic.Field(
        default_factory=lambda: list(DEFAULT_RETRY_ON),
        description="How an attempt must have ended to be retried: node_failure (a node or a rank "
        "lost), preemption, timeout, oom, failure (the job's own exception: only when asked).",
    )

    def wait_s(self, ended_attempt: int) -> float:
        """The backoff after attempt `ended_attempt` (1 for the first) ended."""
        return float(min(MAX_RETRY_WAIT_S, self.backoff_s * self.backoff_factor ** (ended_attempt - 1)))


class JobCreate(JobBase):
    """The body of POST /api/v1/jobs."""

    model_config = ConfigDict(extra="forbid")  # type: ignore[assignment]

    entrypoint: str | None = Field(
        default=None, max_length=300, description="'package.module:function' called on every rank."
    )
    script: str | None = Field(
        default=None, max_length=4096, description="Path to a torchrun-style Python script."
    )
    args: list[str] = Field(default_factory=list, description="Arguments for the script.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the function.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for every rank.")
    # A Literal, not a str checked later: the OpenAPI schema then says which values are accepted.
    backend: Literal["local", "slurm"] | None = Field(
        default=None, description="'local' or 'slurm'; default from settings."
    )
    resources: Resources = Field(default_factory=Resources)
    retries: RetryPolicy = Field(
        default_factory=RetryPolicy,
        description='Attempts after one that ended for a reason not the job\'s own; {"max": 0} for none.',
    )
    checkpoints: CheckpointPolicy | None = Field(
        default=None,
        description='Which of rank 0\'s checkpoints are kept as the job runs, e.g. {"keep_last": 2, '
        '"keep_best": {"metric": "loss", "goal": "min"}}; none: every one.',
    )
    code: str | None = Field(
        default=None,
        max_length=71,
        description="A code snapshot (POST /api/v1/code) the ranks run in: their working directory and "
        "first on their import path.",
    )
    python: str | None = Field(
        default=None,
        max_length=4096,
        description="The interpreter the ranks run (absolute; from TORCHYARD_ALLOWED_PYTHONS).",
    )

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str | None) -> str | None:
        return check_entrypoint(value)

    @field_validator("code")
    @classmethod
    def _code_id(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(CODE_ID_PATTERN, value):
            raise ValueError("must be a code snapshot id, 'sha256:<64 hex digits>' (POST /api/v1/code)")
        return value

    _servable = field_validator("name", "script", "args", "env", "kwargs", "python")(servable)

    @model_validator(mode="after")
    def _one_target_and_room(self) -> JobCreate:
        check_one_target(self.entrypoint, self.script)
        size = len(json.dumps([self.kwargs, self.args, self.env]))
        if size > MAX_SPEC_VALUES_BYTES:
            raise ValueError(
                f"kwargs, args and env hold {size} bytes of JSON together, above the "
                f"{MAX_SPEC_VALUES_BYTES} this service takes (pass large inputs as files)"
            )
        return self


class Job(JobBase, table=True):
    __table_args__ = (
        Index("ix_job_state_backend", "state", "backend"),
        Index("ix_job_state_id", "state", "id"),  # a state's newest first (the list's ?state=)
        Index("ix_job_updated_at_id", "updated_at", "id"),
        Index("ix_job_owner_idempotency", "owner", "idempotency_key", unique=True),
        Index("ix_job_owner_state_id", "owner", "state", "id"),  # also quotas' count of active jobs
        Index("ix_job_folder_removed_finished", "folder_removed_at", "finished_at"),  # retention's due jobs
        Index("ix_job_folder_bytes", "folder_bytes"),  # NULL: not measured since it ended
    )

    id: int | None = Field(default=None, primary_key=True)
    owner: str = Field(default="anonymous", max_length=200, index=True)
    run_as: str | None = Field(default=None, max_length=64)  # the Unix account (service.accounts)
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    backend: str = Field(max_length=20)
    state: JobState = Field(default=JobState.queued, sa_type=String(20))  # plain text: no DB enum to migrate
    reason: str | None = Field(default=None)
    exit_code: int | None = None
    external_id: str | None = Field(default=None, max_length=64, index=True)
    folder: str | None = None
    attempt: int = 1
    # The attempt number the ranks of the current submission carry (RunSpec.attempt): a SLURM requeue
    # starts a new attempt in the ledger, but the requeued ranks still write this one's number.
    run_attempt: int | None = None
    retries: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))  # RetryPolicy
    retry_at: datetime | None = _time_column()  # retrying: the next attempt goes out from then
    nodes: str | None = None  # the hosts the current attempt runs on, as the scheduler lists them
    placement: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    attempt_started_at: datetime | None = _time_column()
    expected_start_at: datetime | None = _time_column()  # while waiting: the scheduler's estimate
    result: Any | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    progress: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    progress_offset: int = 0  # bytes of the progress file already read into the ledger
    latest_checkpoint: str | None = None
    cancel_requested: bool = False
    claimed_by: str | None = Field(default=None, max_length=100)  # dispatcher replica holding it
    claimed_at: datetime | None = _time_column()
    idempotency_key: str | None = Field(default=None, max_length=200)
    sweep_id: int | None = Field(default=None, foreign_key="sweep.id", index=True)
    params: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))  # its trial's
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    submitted_at: datetime | None = _time_column()
    started_at: datetime | None = _time_column()
    finished_at: datetime | None = _time_column()
    # The job folder on disk (service.domain.retention): its size when last measured, and what of it
    # retention removed (everything but the logs, then the whole folder).
    folder_bytes: int | None = Field(default=None, sa_type=BigInteger)
    folder_measured_at: datetime | None = _time_column()
    files_removed_at: datetime | None = _time_column()
    folder_removed_at: datetime | None = _time_column()

    @property
    def resources(self) -> Resources:
        """What the job asked for, from its spec (checked at admission): its world size is
        `resources.world_size`, the one definition the ranks use too."""
        return Resources.model_validate(self.spec.get("resources") or {})


@dataclass(frozen=True)
class NewJob:
    """A job as a request asks for it, before it is stored: what service.loops.intake writes in batches.

    A plain dataclass, not a Job: building an ORM object per POST costs the event loop more than
    the whole group-commit insert of that row costs the writer."""

    name: str
    owner: str
    backend: str
    spec: dict[str, Any]
    run_as: str | None = None
    idempotency_key: str | None = None
    retries: dict[str, Any] | None = None  # a RetryPolicy, as JSON
    params: dict[str, Any] | None = None  # a sweep trial's parameters (its sweep_id comes at commit)
    created_at: datetime = dataclass_field(default_factory=utcnow)


class JobPublic(JobBase):
    id: int
    owner: str
    run_as: str | None = Field(description="The Unix account the job's processes run as.")
    backend: str
    state: JobState
    reason: str | None
    exit_code: int | None
    external_id: str | None
    folder: str | None
    attempt: int
    retries: RetryPolicy | None = Field(description="The retry policy (none for jobs older than retries).")
    retry_at: datetime | None = Field(description="While retrying: when the next attempt goes out.")
    nodes: str | None = Field(description="The hosts the current (or last) attempt ran on.")
    placement: list[RankPlacement] | None = Field(
        description="Where each rank of the current attempt runs (from the ranks themselves)."
    )
    expected_start_at: datetime | None = Field(
        description="While the job waits in the scheduler's queue: when the scheduler expects to start "
        "it (SLURM's own estimate; it moves as other jobs end early or arrive)."
    )
    spec: dict[str, Any]
    sweep_id: int | None = Field(default=None, description="The sweep this job is a trial of.")
    params: dict[str, Any] | None = Field(default=None, description="Its trial's parameters.")
    result: Any | None
    progress: dict[str, Any] | None
    latest_checkpoint: str | None
    cancel_requested: bool
    created_at: datetime
    updated_at: datetime
    submitted_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    folder_bytes: int | None = Field(
        default=None, description="Bytes the job folder takes on disk, as last measured (none: not yet)."
    )
    folder_measured_at: datetime | None = Field(default=None, description="When folder_bytes was measured.")
    files_removed_at: datetime | None = Field(
        default=None, description="When retention removed the folder's checkpoints and files (not its logs)."
    )
    folder_removed_at: datetime | None = Field(default=None, description="When retention removed the folder.")


class JobPage(SQLModel):
    items: list[JobPublic]
    next_cursor: str | None = None
    server_time: datetime | None = Field(
        default=None,
        description="The ledger clock when this page was read: pass it as `since` to get every job "
        "changed after this page (see service.ledger.clock).",
    )


# ---------------------------------------------------------------- sweeps

ParamValue = StrictBool | StrictInt | StrictFloat | StrictStr  # bool first: JSON true is no 1
Goal = Literal["min", "max"]


class JobTemplate(JobCreate):
    """The job of a sweep: a JobCreate without a name (each trial is named after its sweep)."""

    name: None = Field(default=None, description="Leave out: trials are named after the sweep.")  # type: ignore[assignment]


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

    _servable = field_validator("name", "metric")(servable)


class Sweep(SQLModel, table=True):
    """One sweep: the request that made its trials (each trial is a Job with this sweep_id)."""

    __table_args__ = (Index("ix_sweep_owner_idempotency", "owner", "idempotency_key", unique=True),)

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(max_length=200)
    owner: str = Field(max_length=200, index=True)
    backend: str = Field(max_length=20)
    request: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))  # the SweepCreate, as JSON
    size: int  # how many trials it made
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
    created_at: datetime = dataclass_field(default_factory=utcnow)


class TrialPublic(SQLModel):
    job_id: int
    name: str
    params: dict[str, Any]
    state: JobState
    reason: str | None
    metric_last: float | None = Field(description="The sweep's metric as the trial last reported it.")
    metric_best: float | None = Field(description="Its best value so far (by the sweep's goal).")


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
    trials: list[TrialPublic] = Field(description="Every trial, in order (empty in lists).")


class SweepPage(SQLModel):
    items: list[SweepPublic]
    next_cursor: str | None = None


class LedgerClock(SQLModel, table=True):
    """One row, bumped at commit by every transaction that changes a job (service.ledger.clock)."""

    id: int = Field(default=1, primary_key=True)
    seq: int = Field(default=0, sa_type=BigInteger)  # one per commit: 32 bits run out on a busy cluster
    stamped_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


# ---------------------------------------------------------------- history and metrics


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
    started_at: datetime | None = _time_column()
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


class JobFolderPublic(SQLModel):
    """A job folder still on disk, as the housekeeping loop last measured it (GET /api/v1/folders)."""

    id: int = Field(description="The job's id.")
    name: str
    owner: str
    state: JobState
    folder_bytes: int
    folder_measured_at: datetime | None
    finished_at: datetime | None = Field(description="When the job ended (None: not yet).")


class CheckpointPublic(SQLModel):
    """One of rank 0's checkpoints, as its job folder holds it now."""

    name: str = Field(description="File name: ckpt-<epoch or step>.pt (the download's name).")
    step: int = Field(description="The epoch or step it was saved at.")
    bytes: int
    saved_at: datetime
    metrics: dict[str, float | None] = Field(
        default_factory=dict, description="The metrics last reported before it was saved."
    )


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


# ---------------------------------------------------------------- access: tokens and the audit log


class ApiToken(SQLModel, table=True):
    """One API token. Only its SHA-256 is stored: the ledger never holds a usable secret."""

    id: int | None = Field(default=None, primary_key=True)
    username: str = Field(max_length=100, index=True)
    admin: bool = False
    unix_user: str | None = Field(default=None, max_length=64, description="The account jobs run as.")
    allow_code: bool = Field(default=False, description="May run uploaded code (code snapshots).")
    token_hash: str = Field(max_length=64, unique=True)
    prefix: str = Field(max_length=16, description="The token's first characters, to tell tokens apart.")
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    revoked_at: datetime | None = _time_column()


class AuditEntry(SQLModel, table=True):
    """Who did what to which job or token, and when. Written in the same transaction as the act."""

    id: int | None = Field(default=None, primary_key=True)
    time: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)
    actor: str = Field(max_length=100, index=True)
    action: str = Field(max_length=40)
    target: str = Field(max_length=100)
    detail: str | None = None


class AuditEntryPublic(SQLModel):
    id: int
    time: datetime
    actor: str
    action: str
    target: str
    detail: str | None


class UserQuota(SQLModel, table=True):
    """One user's limits where they differ from the service's defaults (a missing value: the default)."""

    username: str = Field(primary_key=True, max_length=100)
    max_active_jobs: int | None = None
    max_submissions_per_minute: int | None = None
    max_nodes: int | None = None
    max_tasks: int | None = None
    max_gpus: int | None = None
    keep_finished_days: float | None = None  # 0: for ever (TORCHYARD_KEEP_FINISHED_DAYS)
    allow_code: bool | None = None  # may run uploaded code; None: as the user's token says


# ---------------------------------------------------------------- code snapshots


class CodeSnapshot(SQLModel, table=True):
    """One user's claim on one stored snapshot: the files are stored once, by content, however many
    users upload them (service.domain.code_store)."""

    digest: str = Field(primary_key=True, max_length=64)  # SHA-256 of the archive, hex
    owner: str = Field(primary_key=True, max_length=100)
    bytes: int = Field(sa_type=BigInteger)
    files: int
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    # Its latest upload by this owner: collection keeps a snapshot TORCHYARD_CODE_KEEP_H after it.
    uploaded_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class CodeSnapshotPublic(BaseModel):
    """The answer to an upload."""

    id: str = pydantic.Field(description="`sha256:<hex>`: what a job's `code` names.")
    bytes: int = pydantic.Field(description="The archive's size.")
    files: int = pydantic.Field(description="Files in it (links included, folders not).")
    created_at: datetime = pydantic.Field(description="When you first uploaded it.")
    uploaded_at: datetime = pydantic.Field(
        description="When you last uploaded it: the service keeps it TORCHYARD_CODE_KEEP_H hours after the "
        "latest upload by anyone, and while an unfinished job uses it."
    )


class CodeSnapshotDetail(CodeSnapshotPublic):
    """One snapshot with its file list."""

    paths: list[str] = pydantic.Field(description="Its files, sorted (at most 10000 shown).")
