"""The Job table and its model family (JobCreate -> Job -> JobPublic, NewJob for the intake), the retry
policy a job carries, and the public models of a job's folder and checkpoints."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, ValidationInfo, computed_field, field_validator, model_validator
from sqlalchemy import JSON, BigInteger, Column, Index, String
from sqlmodel import Field, SQLModel

from service.ledger.models.columns import UTCDateTime, time_column, utcnow
from service.ledger.models.goodput import Goodput
from service.ledger.models.notifications import NotifySpec
from service.ledger.models.pipelines import MAX_AFTER, Dependency
from service.states import JobState
from worker.spec import (
    CODE_ID_PATTERN,
    CheckpointPolicy,
    RankPlacement,
    Resources,
    RestartPolicy,
    Watchdog,
    check_entrypoint,
    check_one_target,
    json_problem,
)

MAX_SPEC_VALUES_BYTES = 256 * 1024  # kwargs, args and env of one job, as JSON


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


RetryOn = Literal["failure", "node_failure", "preemption", "timeout", "oom", "hang"]
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
        'lost), preemption, timeout, oom, hang (stalled with `watchdog.on_stall` "fail"), failure (the '
        "job's own exception: only when asked).",
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
    restarts: RestartPolicy = Field(
        default_factory=RestartPolicy,
        description='Restarts in place inside the same allocation, from the newest whole checkpoint, '
        'before an attempt ends (then `retries` decide), e.g. {"max": 2, "on": ["node_failure", "hang"]}; '
        '{"max": 0} for none.',
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
    watchdog: Watchdog | None = Field(
        default=None,
        description='When the running job counts as stalled and what then, e.g. {"stall_after_s": 600, '
        '"on_stall": "fail"}; none: stalls are reported at a threshold adapted to the job\'s pace.',
    )
    after: list[Dependency] = Field(
        default_factory=list,
        max_length=MAX_AFTER,
        description='Jobs this one runs after: ids ([12, 13]: once they succeeded) or {"job": 12, "on": '
        '"succeeded" | "failed" | "ended"}. Until then the job is waiting; a dependency that can no '
        "longer be met cancels it, naming that dependency. Its entrypoint reads what they left in "
        "ctx.upstream.",
    )
    notify: list[NotifySpec] = Field(
        default_factory=list,
        max_length=10,
        description='Webhooks told when the job reaches a state, e.g. [{"url": '
        '"https://hooks.example.org/x", "on": ["failed", "succeeded"]}] (`on`: job states or "ended", '
        'by default "ended"). Each becomes a subscription bound to the job '
        "(GET /api/v1/notifications/subscriptions).",
    )

    @field_validator("after", mode="before")
    @classmethod
    def _after_ids(cls, value: Any) -> Any:
        """A bare id is a dependency on that job's success."""
        if isinstance(value, list):
            return [{"job": one} if type(one) is int else one for one in value]
        return value

    @field_validator("after")
    @classmethod
    def _after_once(cls, value: list[Dependency]) -> list[Dependency]:
        seen: set[int] = set()
        for position, dependency in enumerate(value):
            if dependency.job in seen:
                raise ValueError(f"after.{position} names job {dependency.job} a second time")
            seen.add(dependency.job)
        return value

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
    retry_at: datetime | None = time_column()  # retrying: the next attempt goes out from then
    nodes: str | None = None  # the hosts the current attempt runs on, as the scheduler lists them
    placement: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    attempt_started_at: datetime | None = time_column()
    expected_start_at: datetime | None = time_column()  # while waiting: the scheduler's estimate
    result: Any | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    progress: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    progress_offset: int = 0  # bytes of the progress file already read into the ledger
    latest_checkpoint: str | None = None
    cancel_requested: bool = False
    claimed_by: str | None = Field(default=None, max_length=100)  # dispatcher replica holding it
    claimed_at: datetime | None = time_column()
    idempotency_key: str | None = Field(default=None, max_length=200)
    sweep_id: int | None = Field(default=None, foreign_key="sweep.id", index=True)
    params: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))  # its trial's
    resumes: int | None = Field(default=None, index=True)  # the pruned trial it continues (sweep_resume)
    pipeline_id: int | None = Field(default=None, foreign_key="pipeline.id", index=True)
    stage: str | None = Field(default=None, max_length=100)  # its pipeline's stage
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    submitted_at: datetime | None = time_column()
    started_at: datetime | None = time_column()
    finished_at: datetime | None = time_column()
    # The job folder on disk (service.domain.retention): its size when last measured, and what of it
    # retention removed (everything but the logs, then the whole folder).
    folder_bytes: int | None = Field(default=None, sa_type=BigInteger)
    folder_measured_at: datetime | None = time_column()
    files_removed_at: datetime | None = time_column()
    folder_removed_at: datetime | None = time_column()
    # The watchdog (service.domain.watchdog): when the service last read a new report of the current
    # attempt (its own clock), the times of the attempt's last reports (rank 0's clock: their gaps
    # are the job's pace), and, while the attempt is stalled, since when and why.
    progress_at: datetime | None = time_column()
    report_times: list[float] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    stalled_at: datetime | None = time_column()
    stall_reason: str | None = None
    # Restarts in place (service.loops.restarts): how many the job had, how far its restarts.jsonl is
    # read, their records (bounded; its events and goodput are made from them) and its goodput.
    restart_count: int = 0
    restarts_offset: int = 0
    restart_log: list[dict[str, Any]] | None = Field(default=None, sa_column=Column(JSON, nullable=True))
    goodput: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON, nullable=True))

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
    resumes: int | None = None  # a resumed trial: the pruned job it continues, from resume_from
    resume_from: str | None = None  # the checkpoint its first attempt starts from (latest_checkpoint)
    after: tuple[Dependency, ...] = ()  # it is stored waiting when it has any
    notify: tuple[NotifySpec, ...] = ()  # webhooks, stored as subscriptions bound to it
    pipeline_id: int | None = None
    stage: str | None = None
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
    pipeline_id: int | None = Field(default=None, description="The pipeline this job is a stage of.")
    stage: str | None = Field(default=None, description="Its stage in that pipeline.")
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
    stalled_at: datetime | None = Field(
        default=None,
        description="While the running attempt makes no progress (no report, its ranks' stacks unchanged) "
        "past its watchdog's threshold: since when it is stalled. Cleared when progress resumes.",
    )
    stall_reason: str | None = Field(
        default=None, description="Why it is stalled: which rank is where (from its ranks' stacks)."
    )
    restart_count: int = Field(default=0, description="Restarts in place the job had, all attempts together.")
    goodput: Goodput | None = Field(default=None, description="Its wall time split: what was kept, and lost.")

    @computed_field(description="The restart policy (restarts in place), as the job was submitted.")  # type: ignore[prop-decorator]
    @property
    def restarts(self) -> RestartPolicy:
        return RestartPolicy.model_validate(self.spec.get("restarts") or {})


class JobPage(SQLModel):
    items: list[JobPublic]
    next_cursor: str | None = None
    server_time: datetime | None = Field(
        default=None,
        description="The ledger clock when this page was read: pass it as `since` to get every job "
        "changed after this page (see service.ledger.clock).",
    )


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
