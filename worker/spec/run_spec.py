"""The RunSpec the service builds for every job attempt, and what it asks for: the resources, the
checkpoint policy, the array group, the code snapshot."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from worker.spec.job_files import JobFiles
from worker.spec.records import MAX_METRIC_NAME_CHARS

ENTRYPOINT_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
SLURM_NAME_PATTERN = r"^[A-Za-z0-9_.\-]+$"
# A node feature expression for sbatch --constraint: names joined by & | , with counts and brackets.
SLURM_CONSTRAINT_PATTERN = r"^[A-Za-z0-9_.\-&|,*\[\]()]+$"
MAX_SPARE_NODES = 64
CODE_ID_PREFIX = "sha256:"
CODE_ID_PATTERN = rf"^{CODE_ID_PREFIX}[0-9a-f]{{64}}$"  # a code snapshot's id: the SHA-256 of its archive


def check_entrypoint(value: str | None) -> str | None:
    """'package.module:function', whole string (match() would let a trailing newline through)."""
    if value is not None and not ENTRYPOINT_PATTERN.fullmatch(value):
        raise ValueError("must look like 'package.module:function'")
    return value


def check_one_target(entrypoint: str | None, script: str | None) -> None:
    if (entrypoint is None) == (script is None):
        raise ValueError("give exactly one of 'entrypoint' or 'script'")


class Resources(BaseModel):
    """What one job asks of the machine or cluster."""

    model_config = ConfigDict(extra="forbid")

    nodes: int = Field(1, ge=1, description="Number of nodes (hosts).")
    tasks_per_node: int = Field(1, ge=1, description="Ranks per node.")
    # Upper bounds far above any machine's, so that no number reaches sbatch or OMP_NUM_THREADS that
    # they cannot take (1e308 GiB overflowed the conversion to MiB).
    cpus_per_task: int = Field(1, ge=1, le=4096, description="CPU cores per rank.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node; 0 runs on CPU with gloo.")
    mem_gb: float | None = Field(
        None, gt=0, le=1_048_576, allow_inf_nan=False, description="Memory per node in GiB (at most 1 PiB)."
    )
    timeout_min: int = Field(60, ge=1, le=60 * 24 * 30, description="Wall-clock limit in minutes.")
    partition: str | None = Field(None, max_length=128, pattern=SLURM_NAME_PATTERN)
    # SLURM only (sbatch --account/--qos/--constraint); other backends ignore them.
    account: str | None = Field(None, max_length=128, pattern=SLURM_NAME_PATTERN)
    qos: str | None = Field(None, max_length=128, pattern=SLURM_NAME_PATTERN)
    constraint: str | None = Field(None, max_length=256, pattern=SLURM_CONSTRAINT_PATTERN)
    spare_nodes: int = Field(
        0,
        ge=0,
        le=MAX_SPARE_NODES,
        description="SLURM only: nodes more than `nodes` that wait idle in the allocation; a restart in "
        "place takes one in place of a lost node, so the world size stays the same.",
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.tasks_per_node


class ArrayGroup(BaseModel):
    """Jobs the scheduler should take as one array (a sweep's trials): the service's concern, which
    the ranks ignore. `max_parallel`: at most this many of them run at once (SLURM's `%N`)."""

    model_config = ConfigDict(extra="forbid")

    key: str
    max_parallel: int | None = None


class KeepBest(BaseModel):
    """Keep the checkpoint whose `metric` (as last reported before it was saved) is best."""

    model_config = ConfigDict(extra="forbid")

    metric: str = Field(
        min_length=1,
        max_length=MAX_METRIC_NAME_CHARS,
        pattern=r"^[^\x00]+$",
        description="A metric the job reports (`ctx.report(..., loss=...)`).",
    )
    goal: Literal["min", "max"] = Field("min", description="Lowest (`min`) or highest (`max`) is best.")


class CheckpointPolicy(BaseModel):
    """Which of rank 0's checkpoints are kept while the job runs; the rest are deleted as it saves.

    The newest is always kept (a restarted attempt resumes from it), so `keep_last` is at least 1;
    with neither rule every checkpoint stays."""

    model_config = ConfigDict(extra="forbid")

    keep_last: int | None = Field(None, ge=1, le=100_000, description="Keep the newest N checkpoints.")
    keep_best: KeepBest | None = Field(None, description="Also keep the best one by a reported metric.")


RestartCause = Literal["node_failure", "hang", "failure"]
DEFAULT_RESTART_ON: tuple[RestartCause, ...] = ("node_failure", "hang")  # not the job's own exception
MAX_RESTARTS = 100


class RestartPolicy(BaseModel):
    """When an attempt is restarted in place (every rank stopped and started again inside the same
    allocation, from the newest whole checkpoint), by the job's own supervisor (worker.supervisor)."""

    model_config = ConfigDict(extra="forbid")

    max: int = Field(2, ge=0, le=MAX_RESTARTS, description="Restarts in place per attempt; 0: none.")
    on: list[RestartCause] = Field(
        default_factory=lambda: list(DEFAULT_RESTART_ON),
        max_length=3,
        description="What is restarted in place: node_failure (a rank vanished or its node was lost), hang "
        "(the watchdog found it stalled, with `watchdog.on_stall: fail`), failure (the job's own exception).",
    )

    @field_validator("on")
    @classmethod
    def _each_once(cls, value: list[RestartCause]) -> list[RestartCause]:
        if len(set(value)) != len(value):
            raise ValueError("names a cause twice")
        return value


MIN_STALL_AFTER_S = 15.0  # three of a rank's activity samples (worker.stacks samples every 5 s)
MAX_STALL_AFTER_S = 30 * 24 * 3600.0


class Watchdog(BaseModel):
    """When a running job counts as stalled, and what then: the service's concern (its reconcile loop
    decides from the job's reports and its ranks' activity files); the ranks carry it unread."""

    model_config = ConfigDict(extra="forbid")

    stall_after_s: float | None = Field(
        None,
        ge=MIN_STALL_AFTER_S,
        le=MAX_STALL_AFTER_S,
        allow_inf_nan=False,
        description="Seconds without progress (a report, or a change in what the ranks run) before the "
        "job is stalled; none: adapted to the job's pace (at least 120 s, 10x its usual gap between "
        "reports; 300 s for a job that reports nothing).",
    )
    on_stall: Literal["report", "fail"] = Field(
        "report",
        description="`report`: flag the job stalled (with every rank's stack) and let it run; `fail`: also "
        "end the attempt as `hang` (retried when `retries.on` holds it).",
    )


def tracker_run_id(job_id: int, created_at: datetime) -> str:
    """A job's RunSpec.run_id: its id and when it was made, so that a new ledger, whose ids count from
    1 again, never resumes an older ledger's run in an experiment tracker."""
    return f"torchyard-{job_id}-{created_at:%Y%m%dT%H%M%S}"


class UpstreamJob(BaseModel):
    """A job this one ran after, as the service read it when this attempt went out."""

    model_config = ConfigDict(extra="forbid")

    job_id: int
    name: str
    stage: str | None = None  # its pipeline's stage, when it is one
    state: str  # how it ended: succeeded, failed, cancelled or timeout
    result: Any = None  # what its entrypoint returned (rank 0's)
    checkpoint: str | None = None  # the newest checkpoint it saved (a path), if any


class RunSpec(BaseModel):
    """Everything a rank needs to run one attempt of a job."""

    model_config = ConfigDict(extra="forbid")

    job_id: int
    name: str
    attempt: int = 1
    entrypoint: str | None = None
    script: str | None = None
    args: list[str] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    env: dict[str, str] = Field(default_factory=dict)
    resources: Resources = Field(default_factory=Resources)
    folder: str
    rendezvous_timeout_s: float = Field(300.0, gt=0)
    resume_from: str | None = None  # checkpoint path the ledger last recorded
    run_as: str | None = None  # the Unix account the service starts this job's processes as
    group: ArrayGroup | None = None  # submitted with the other jobs of this group, as one array
    checkpoints: CheckpointPolicy | None = None  # None: every checkpoint is kept
    code: str | None = Field(None, pattern=CODE_ID_PATTERN)  # unpacked in JobFiles.code by the service
    python: str | None = None  # the interpreter the ranks run; None: the service's job Python
    watchdog: Watchdog | None = None  # the service's stall rules; the ranks ignore it
    restarts: RestartPolicy = Field(default_factory=RestartPolicy)  # the supervisor's (worker.supervisor)
    upstream: list[UpstreamJob] = Field(default_factory=list)  # the jobs it ran after, in `after` order
    # The same over the job's retries and requeues, and unique beyond this ledger's ids (a new ledger
    # counts from 1 again): what an experiment tracker resumes one run by. Empty: `job-<id>`.
    run_id: str = Field("", max_length=100, pattern=r"^[A-Za-z0-9_.\-]*$")

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_shape(cls, value: str | None) -> str | None:
        return check_entrypoint(value)

    @model_validator(mode="after")
    def _exactly_one_target(self) -> RunSpec:
        check_one_target(self.entrypoint, self.script)
        return self

    @property
    def files(self) -> JobFiles:
        return JobFiles(Path(self.folder))

    @property
    def run_name(self) -> str:
        return self.run_id or f"job-{self.job_id}"
