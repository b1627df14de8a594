"""What the ranks write into the job's folder, and the one parser of each: progress lines
(ProgressRecord, CheckpointRecord), placement files (RankPlacement), error files' attempt line,
checkpoint notes, activity files (RankActivity). A job is untrusted: whatever a file holds costs
that file or line at most."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from worker.spec.cleaning import ascii_int, clean_text, storable, unservable_text

# What the ranks that survive a lost peer raise: gloo's and NCCL's words for a vanished process. The
# service tells a job's own failure from a lost rank by it, and so does the job's supervisor.
LOST_PEER = re.compile(
    r"connection (closed|reset) by peer|broken pipe|communicator was aborted|remote process exited"
    r"|watchdog caught collective operation timeout|DistNetworkError|(recv|send)Bytes failed"
    r"|socket timeout|ProcessGroupNCCL.*(error|abort)"
    r"|wait timeout after|waiting for clients",  # the rendezvous store: a rank never joined
    re.IGNORECASE,
)
ERROR_ATTEMPT_PREFIX = "attempt: "  # the first line of an error file: `attempt: <n>`
MAX_COUNT = 2**31 - 1  # steps and attempts: the ledger keeps them in 32-bit INTEGER columns
PROGRESS_KEYS = ("step", "total", "metrics", "time", "attempt")  # a progress line, as ctx.report writes it
# A job's metrics, bounded because a job writes its progress file and every metric is a ledger row
# written inside the reconcile loop's transaction. A line's metrics past the first MAX_METRICS_PER_LINE
# and names longer than the ledger's column are dropped by the parser; new names past a job's first
# MAX_METRIC_NAMES are dropped by the service, which alone knows the names stored before.
MAX_METRIC_NAME_CHARS = 100  # the ledger's JobMetric.name column
MAX_METRICS_PER_LINE = 64
MAX_METRIC_NAMES = 256


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
    pid: int | None = None  # the rank's process on its host (py-spy, a test's kill); None: not said


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
    return RankPlacement(rank=rank, host=host, local_rank=local_rank, gpu=gpu, protected_hardlinks=protected,
                         pid=_count(data.get("pid")))


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
        if not isinstance(path, str) or len(path) > MAX_PATH_CHARS or unservable_text(path):
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
    problem = unservable_text(name)
    return None if problem is None else f"holds {problem}"


ACTIVITY_INTERVAL_S = 5.0  # how often a rank's activity thread rewrites its activity file
MAX_WHERE_CHARS = 600  # of an activity file's `where`: "file:line function"


class RankActivity(BaseModel):
    """What one rank's main thread was doing, as its activity thread last saw it (JobFiles.activity).

    `time` is when the thread last wrote (it stops when the rank's Python cannot run: C code holding
    the GIL), `changed_at` when the main thread's stack last differed from the sample before, `where`
    the main thread's innermost frame of the job's own code, "file:line function" (None: not known).
    Times are seconds since the epoch on the rank's host's clock."""

    attempt: int
    rank: int
    host: str
    pid: int
    time: float
    changed_at: float
    where: str | None = None


def parse_activity(text: str) -> RankActivity | None:
    """An activity file's record, or None: torn or unusable (a job wrote it). Text is cleaned and
    bounded, numbers must be usable (whole numbers within MAX_COUNT, finite times)."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    attempt, rank, pid = _count(data.get("attempt")), _count(data.get("rank")), _count(data.get("pid"))
    time, changed_at, host = _number(data.get("time")), _number(data.get("changed_at")), data.get("host")
    if attempt is None or rank is None or pid is None or time is None or changed_at is None:
        return None
    if not _short_text(host, MAX_HOST_CHARS):
        return None
    where = data.get("where")
    where = clean_text(where, MAX_WHERE_CHARS) if isinstance(where, str) and where else None
    return RankActivity(attempt=attempt, rank=rank, host=host, pid=pid, time=time,
                        changed_at=min(changed_at, time), where=where)  # fmt: skip


# ---------------------------------------------------------------- restarts in place (worker.supervisor)

RESTART_OUTCOMES = ("restarted", "gave_up")
RESTART_CAUSES = ("node_failure", "hang", "failure")
MAX_RESTART_TEXT = 500  # a restart record's detail and reason
MAX_RESTART_NODES = 1024


class RestartRecord(BaseModel):
    """A line of restarts.jsonl, written by the job's supervisor (it runs as the job's account, so the
    service reads it as any file the job wrote: parse_restart_line).

    - outcome "restarted": restart number `restart` (1 for the first) of the attempt; the run that was
      lost (`cause`, the `rank` and `node` first lost, `detail` in words) was stopped at `lost_at` and a
      new run started on `nodes` at `started_at`, resuming from `resumed_from` (step `resumed_step`).
    - outcome "gave_up": the attempt ends here and the service settles it as before; `reason` says why
      it was not restarted in place (restarts spent, too few usable nodes), `restart` how many were done.
    """

    attempt: int
    restart: int
    outcome: str
    cause: str
    rank: int | None = None
    node: str | None = None
    detail: str = ""
    lost_at: float | None = None
    started_at: float | None = None
    resumed_from: str | None = None
    resumed_step: int | None = None
    nodes: list[str] = Field(default_factory=list)
    max: int | None = None
    reason: str = ""


def parse_restart_line(line: str | bytes) -> RestartRecord | None:
    """One line of restarts.jsonl as a record; None for a blank, torn or unusable line (a job may write
    anything there). Texts are cleaned and cut to MAX_RESTART_TEXT, node names that are not short
    printable text dropped, numbers that are not usable made None."""
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    attempt, restart = _count(data.get("attempt")), _count(data.get("restart"))
    outcome, cause = data.get("outcome"), data.get("cause")
    if attempt is None or restart is None or outcome not in RESTART_OUTCOMES or cause not in RESTART_CAUSES:
        return None
    node = data.get("node")
    nodes = data.get("nodes")
    path = data.get("resumed_from")
    usable_path = isinstance(path, str) and len(path) <= MAX_PATH_CHARS and not unservable_text(path)
    return RestartRecord(
        attempt=attempt,
        restart=restart,
        outcome=outcome,
        cause=cause,
        rank=_count(data.get("rank")),
        node=node if _short_text(node, MAX_HOST_CHARS) else None,
        detail=_restart_text(data.get("detail")),
        lost_at=_number(data.get("lost_at")),
        started_at=_number(data.get("started_at")),
        resumed_from=path if usable_path else None,
        resumed_step=_count(data.get("resumed_step")),
        nodes=[one for one in nodes[:MAX_RESTART_NODES] if _short_text(one, MAX_HOST_CHARS)]
        if isinstance(nodes, list)
        else [],
        max=_count(data.get("max")),
        reason=_restart_text(data.get("reason")),
    )


class RestartRequest(BaseModel):
    """restart-request.json, written by the service: restart run `run` (0: the attempt's first run,
    k: the run after restart k) of `attempt` in place, because of `cause`."""

    attempt: int
    run: int
    cause: str
    detail: str = ""


def parse_restart_request(text: str | bytes) -> RestartRequest | None:
    """The request in restart-request.json, None for a torn or unusable one."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    attempt, run, cause = _count(data.get("attempt")), _count(data.get("run")), data.get("cause")
    if attempt is None or run is None or cause not in RESTART_CAUSES:
        return None
    return RestartRequest(attempt=attempt, run=run, cause=cause, detail=_restart_text(data.get("detail")))


def _restart_text(value: Any) -> str:
    return clean_text(value, MAX_RESTART_TEXT) if isinstance(value, str) else ""
