"""The contract between the service and the worker: plain pydantic, no torch, no service imports.

The service builds a RunSpec for every job attempt and hands it (as JSON) to submitit; every rank
receives the same RunSpec. Files the two sides exchange live in the job's folder (see JobFiles).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ENTRYPOINT_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$")
SLURM_NAME_PATTERN = r"^[A-Za-z0-9_.\-]+$"
# A node feature expression for sbatch --constraint: names joined by & | , with counts and brackets.
SLURM_CONSTRAINT_PATTERN = r"^[A-Za-z0-9_.\-&|,*\[\]()]+$"
CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d+)\.pt$")  # checkpoints/ckpt-<epoch or step, 8 digits>.pt
CHECKPOINT_NOTE_SUFFIX = ".json"  # ckpt-<n>.json beside ckpt-<n>.pt: the metrics reported when it was saved
ERROR_ATTEMPT_PREFIX = "attempt: "  # the first line of an error file: `attempt: <n>`
MAX_COUNT = 2**31 - 1  # steps and attempts: the ledger keeps them in 32-bit INTEGER columns
PROGRESS_KEYS = ("step", "total", "metrics", "time", "attempt")  # a progress line, as ctx.report writes it
JOB_DIR_ENV = "TORCHYARD_JOB_DIR"  # every rank's: its job's folder, where a job writes what it keeps
CHECKPOINT_DIR_ENV = "TORCHYARD_CHECKPOINT_DIR"  # every rank's: where checkpoints go (JobFiles.checkpoints)
CODE_ID_PREFIX = "sha256:"
CODE_ID_PATTERN = rf"^{CODE_ID_PREFIX}[0-9a-f]{{64}}$"  # a code snapshot's id: the SHA-256 of its archive
MAX_JSON_DEPTH = 32  # nesting of any JSON value the service stores (kwargs, results, progress)
# A job's metrics, bounded because a job writes its progress file and every metric is a ledger row
# written inside the reconcile loop's transaction. A line's metrics past the first MAX_METRICS_PER_LINE
# and names longer than the ledger's column are dropped by the parser; new names past a job's first
# MAX_METRIC_NAMES are dropped by the service, which alone knows the names stored before.
MAX_METRIC_NAME_CHARS = 100  # the ledger's JobMetric.name column
MAX_METRICS_PER_LINE = 64
MAX_METRIC_NAMES = 256
_SURROGATE = re.compile("[\ud800-\udfff]")  # half of a UTF-16 pair: valid JSON text, not UTF-8


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


class JobFiles:
    """Names of the files inside a job's folder, known to both sides."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @property
    def spec(self) -> Path:
        """The RunSpec of the attempt that last started, written by its rank 0 (for people to read)."""
        return self.folder / "spec.json"

    @property
    def progress(self) -> Path:
        """JSON lines appended by rank 0: {"step", "total", "metrics", "time", "attempt"}."""
        return self.folder / "progress.jsonl"

    @property
    def result(self) -> Path:
        """Written atomically by rank 0 on success: {"attempt", "value"}."""
        return self.folder / "result.json"

    def error(self, rank: int) -> Path:
        """Written atomically by a rank that raised: a first line `attempt: <n>`, then its traceback.

        A rank removes its own when it starts, but a reader may still find one an earlier attempt
        left behind: parse_error_text() says which attempt wrote it.
        """
        return self.folder / f"error-rank{rank}.txt"

    def placement(self, rank: int) -> Path:
        """Written atomically by every rank when it starts: {"attempt", "rank", "host", "local_rank",
        "gpu"} (parse_placement), so the service knows where each rank of the attempt runs."""
        return self.folder / "placement" / f"rank{rank}.json"

    def rendezvous(self, key: str) -> Path:
        """Written atomically by rank 0 before the others connect: {"addr", "port", "host", "pid"}.

        `key` names one run of the ranks (worker.rendezvous.rendezvous_key), so a retried or requeued
        job never reads an earlier run's port.
        """
        return self.folder / "rendezvous" / f"{key}.json"

    @property
    def code(self) -> Path:
        """The job's code snapshot, unpacked read-only by the service: the ranks' working directory."""
        return self.folder / "code"

    @property
    def checkpoints(self) -> Path:
        return self.folder / "checkpoints"

    @property
    def tmp(self) -> Path:
        """The ranks' TMPDIR: temporary files stay inside the job's own folder."""
        return self.folder / "tmp"

    @property
    def submitit(self) -> Path:
        """submitit's own folder: pickles and per-rank logs (`<id>_<rank>_log.out|err`)."""
        return self.folder / "submitit"

    def checkpoint_file(self, epoch_or_step: int) -> Path:
        """Where rank 0 saves the checkpoint of this epoch or step (zero-padded, so names sort)."""
        return self.checkpoints / f"ckpt-{epoch_or_step:08d}.pt"

    def checkpoint_note(self, checkpoint: Path) -> Path:
        """The note beside a checkpoint: {"step", "metrics", "time", "attempt"} (parse_checkpoint_note)."""
        return checkpoint.with_suffix(CHECKPOINT_NOTE_SUFFIX)

    def saved_checkpoints(self) -> list[tuple[int, Path]]:
        """(epoch or step, path) of every checkpoint in checkpoints/, oldest first (temp files ignored)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(
            (int(match.group(1)), path)
            for path in self.checkpoints.iterdir()
            if (match := CHECKPOINT_PATTERN.fullmatch(path.name))
        )

    def latest_checkpoint(self) -> Path | None:
        """The checkpoint with the highest epoch or step in checkpoints/, or None (temp files ignored)."""
        saved = self.saved_checkpoints()
        return saved[-1][1] if saved else None


class ProgressRecord(BaseModel):
    """A progress line of progress.jsonl, written by rank 0's `ctx.report(step, total, **metrics)`."""

    step: int
    total: int | None = None
    metrics: dict[str, float | None] = Field(default_factory=dict)  # None: not a finite number
    time: float | None = None  # seconds since the epoch, on rank 0's clock
    attempt: int | None = None
    # What readers are shown as the job's latest progress: the line's five keys as it wrote them, with
    # NaN and infinities made None (JSON has none). A job may write any JSON under those keys and is
    # shown it; what the service relies on (metric rows, times, attempts) is the typed fields above.
    shown: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)

    @model_validator(mode="after")
    def _shows_its_fields_by_default(self) -> ProgressRecord:
        if not self.shown:  # a record built by hand rather than parsed from a line
            self.shown = self.model_dump()
        return self


class CheckpointRecord(BaseModel):
    """A checkpoint line of progress.jsonl: rank 0 saved `checkpoint` (an absolute path) completely."""

    checkpoint: str
    step: int | None = None  # the epoch_or_step given to ctx.save_checkpoint
    time: float | None = None
    attempt: int | None = None


class RankPlacement(BaseModel):
    """Where one rank of an attempt runs: its host, its place on that host, the GPU it was given."""

    rank: int
    host: str
    local_rank: int
    gpu: str | None = None  # as CUDA_VISIBLE_DEVICES names it (an index or a UUID), None on CPU
    protected_hardlinks: bool | None = None  # the host's fs.protected_hardlinks; None: not said


PROTECTED_HARDLINKS = Path("/proc/sys/fs/protected_hardlinks")


def node_hardlinks_protected(setting: Path = PROTECTED_HARDLINKS) -> bool | None:
    """Whether this machine's kernel lets an account hard-link only files it owns (or may read and
    write): fs.protected_hardlinks 1 or 0; None where it cannot tell (not Linux, /proc hidden). The
    service asks it of its own host; each rank writes its node's into its placement file, since a
    SLURM job makes its links on the compute nodes."""
    try:
        return {"1": True, "0": False}.get(setting.read_text().strip())
    except OSError:
        return None


MAX_HOST_CHARS = 255  # a DNS name's length
MAX_PATH_CHARS = 4096  # PATH_MAX: a checkpoint's path, as a progress line names it


def parse_placement(text: str, attempt: int) -> RankPlacement | None:
    """A placement file of `attempt`, or None: another attempt's, torn or unusable (a job wrote it)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or _count(data.get("attempt")) != attempt:
        return None
    rank, local_rank, host, gpu = (_count(data.get("rank")), _count(data.get("local_rank")),
                                   data.get("host"), data.get("gpu"))  # fmt: skip
    if rank is None or local_rank is None or not _short_text(host, MAX_HOST_CHARS):
        return None
    gpu = gpu if _short_text(gpu, 64) else None
    protected = data.get("protected_hardlinks")  # absent from an older worker's file
    protected = protected if isinstance(protected, bool) else None
    return RankPlacement(rank=rank, host=host, local_rank=local_rank, gpu=gpu, protected_hardlinks=protected)


def _short_text(value: Any, most: int) -> bool:
    return isinstance(value, str) and 0 < len(value) <= most and value.isprintable()


def parse_checkpoint_note(text: str) -> dict[str, float | None]:
    """The metrics of a checkpoint's note ({} for a torn or unusable one: a job wrote it)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    return _metrics(data.get("metrics"), MAX_METRIC_NAMES) if isinstance(data, dict) else {}


def parse_error_text(text: str) -> tuple[int | None, str]:
    """An error file's (attempt, traceback); attempt is None for a file without the attempt line."""
    first, newline, rest = text.partition("\n")
    number = ascii_int(first.removeprefix(ERROR_ATTEMPT_PREFIX).strip())
    if first.startswith(ERROR_ATTEMPT_PREFIX) and number is not None:
        return number, rest if newline else ""
    return None, text


MAX_DIGITS = 18  # any count or id a job folder or a scheduler names fits; int() refuses 4,300 and more


def ascii_int(text: str) -> int | None:
    """`text` as a whole number when it is 1 to MAX_DIGITS ASCII digits, else None.

    The one way a number written by a job (a file name, a line of a file) or printed by a command is
    read: str.isdigit() also accepts "²" and other digits that int() then refuses, and a long run of
    digits makes int() raise too, either of which would stop a loop that reads many jobs' files."""
    if 0 < len(text) <= MAX_DIGITS and text.isascii() and text.isdigit():
        return int(text)
    return None


def parse_progress_line(line: str | bytes) -> ProgressRecord | CheckpointRecord | None:
    """One line of progress.jsonl as a record; None for a blank, torn (half-written) or unusable line.

    The one parser of the format, for the service as for the worker. The service reads what a job
    wrote, and a job is untrusted: whatever a line holds costs that line at most, and what a record
    holds can be stored as it is. A line with a "checkpoint" key is a CheckpointRecord (its path a
    string without NUL); any other line needs a `step` (a whole number from 0 to MAX_COUNT). Metric
    values that are not finite numbers become None, metric names with NUL or longer than
    MAX_METRIC_NAME_CHARS are dropped, and so are the metrics after the first MAX_METRICS_PER_LINE; a
    `total`, `time` or `attempt` that is not usable becomes None, all without losing the line; the
    line's five keys as written (NaN and infinities made None) stay in `shown`, for readers.
    Rank 0 appends whole lines, but a reader may catch the file mid-write: read only up to the last
    newline and keep the byte offset there.
    """
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested ~1000 deep
        return None
    if not isinstance(data, dict):
        return None
    common = {"time": _number(data.get("time")), "attempt": _count(data.get("attempt"))}
    if "checkpoint" in data:
        path = data["checkpoint"]
        if not isinstance(path, str) or len(path) > MAX_PATH_CHARS or _unservable_text(path):
            return None
        return CheckpointRecord(checkpoint=path, step=_count(data.get("step")), **common)
    step = _count(data.get("step"))
    if step is None:
        return None
    metrics = _metrics(data.get("metrics"), MAX_METRICS_PER_LINE)
    shown = storable({key: data.get(key) for key in PROGRESS_KEYS})
    return ProgressRecord(step=step, total=_count(data.get("total")), metrics=metrics, shown=shown, **common)


def _count(value: Any) -> int | None:
    """A step, total or attempt: a whole number a 32-bit INTEGER column holds, else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        return None
    return value


def _number(value: Any) -> float | None:
    """A finite number as a float, else None (JSON and the ledger hold no NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return number if math.isfinite(number) else None


def _metrics(value: Any, most: int) -> dict[str, float | None]:
    """The first `most` metrics of `value` whose names the ledger can hold, in the order written."""
    if not isinstance(value, dict):
        return {}
    usable = ((name, item) for name, item in value.items() if _metric_name_problem(str(name)) is None)
    return {str(name): _number(item) for name, item in itertools.islice(usable, most)}


def metrics_problem(names: Collection[str]) -> str | None:
    """Why a progress line with metrics called `names` would not record them all, or None."""
    if len(names) > MAX_METRICS_PER_LINE:
        return f"{len(names)} metrics in one report: a progress line records at most {MAX_METRICS_PER_LINE}"
    for name in names:
        if (problem := _metric_name_problem(name)) is not None:
            return f"the metric name {name if len(name) <= 40 else name[:40] + '...'!r} {problem}"
    return None


def _metric_name_problem(name: str) -> str | None:
    if len(name) > MAX_METRIC_NAME_CHARS:
        return f"is longer than {MAX_METRIC_NAME_CHARS} characters"
    problem = _unservable_text(name)
    return None if problem is None else f"holds {problem}"


def json_problem(value: Any, max_depth: int = MAX_JSON_DEPTH) -> tuple[str, str] | None:
    """Where `value` (parsed JSON) is not something every reader can be served, and why: (the path to
    it, dotted, "" for the value itself; the problem). None when it is fine.

    A lone surrogate ("\\ud800") or a NaN parses, and a row holding one then fails every response
    it is in; NUL cannot be stored by PostgreSQL; deep nesting costs recursion in every reader.
    Iterative, so that no depth of input can exhaust the stack here.
    """
    stack: list[tuple[str, Any, int]] = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, str):
            if held := _unservable_text(item):
                return path, f"must not hold {held}"
        elif isinstance(item, float) and not math.isfinite(item):
            return path, "must be a finite number (NaN and Infinity are not JSON)"
        elif isinstance(item, dict | list):
            if depth >= max_depth:
                return path, f"nests deeper than {max_depth} levels"
            pairs = item.items() if isinstance(item, dict) else enumerate(item)
            for key, child in pairs:
                child_path = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and (held := _unservable_text(key)):
                    return clean_text(child_path), f"its name must not hold {held}"
                stack.append((child_path, child, depth + 1))
    return None


def storable(value: Any, depth: int = 0) -> Any:
    """`value` (parsed JSON a job wrote) made servable: NaN and infinities become None, lone
    surrogates U+FFFD, NUL is dropped, and what nests deeper than MAX_JSON_DEPTH becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict | list):
        if depth >= MAX_JSON_DEPTH:
            return None
        if isinstance(value, dict):
            return {clean_text(str(key)): storable(item, depth + 1) for key, item in value.items()}
        return [storable(item, depth + 1) for item in value]
    return value


def clean_text(text: str, most: int | None = None) -> str:
    """`text` as every reader and column can hold it: lone surrogates become U+FFFD, NUL is dropped,
    and what is past its first `most` characters (when given) is cut. The one cleaner of text a job
    wrote (tracebacks, log tails, JSON values) before it goes near the ledger."""
    cleaned = _SURROGATE.sub("\ufffd", text).replace("\x00", "")
    return cleaned if most is None else cleaned[:most]


def _unservable_text(text: str) -> str | None:
    """What in `text` no response or PostgreSQL column can hold, or None."""
    if _SURROGATE.search(text):
        return "a lone UTF-16 surrogate (it is not UTF-8)"
    if "\x00" in text:
        return "a NUL character"
    return None

