"""Everything the service reads from a job's folder: result, error files, progress, logs' tails and
the id submitit gave it. The file names and formats are the worker's contract (worker/spec.py); the
folder is written by untrusted code, so every reader here takes whatever it finds without failing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.backends.base import SUBMITTED_SUFFIX
from worker.spec import (
    CheckpointRecord,
    JobFiles,
    ProgressRecord,
    parse_error_text,
    parse_placement,
    parse_progress_line,
    storable,
)

log = logging.getLogger(__name__)

MAX_PROGRESS_READ = 4 * 1024 * 1024  # one tick reads at most this much; the rest waits for the next


def read_result(files: JobFiles) -> dict[str, Any] | None:
    """Rank 0's result.json, made storable: a job may write any JSON there, NaN and lone surrogates
    included, and the ledger row must still be servable to every reader."""
    try:
        value = json.loads(files.result.read_text())
    except (FileNotFoundError, ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or "value" not in value:
        return None
    cleaned: dict[str, Any] = storable(value)
    return cleaned


@dataclass(frozen=True)
class RankError:
    rank: int
    text: str  # the traceback, or what the rank wrote instead
    written: float  # when (the file's mtime)


def rank_errors(files: JobFiles) -> list[RankError]:
    """Every rank's error file, the first written first: it is the cause; ranks that fail after it
    usually fail *because* of it (their peer vanished)."""
    found: list[RankError] = []
    for path in files.errors():
        rank = path.stem.removeprefix("error-rank")
        try:
            _, text = parse_error_text(path.read_text(errors="replace"))
            written = path.stat().st_mtime
        except FileNotFoundError:
            continue
        if text.strip() and rank.isdigit():
            found.append(RankError(int(rank), text.strip(), written))
    return sorted(found, key=lambda error: (error.written, error.rank))


def read_placement(files: JobFiles, attempt: int, world_size: int) -> list[dict[str, Any]]:
    """Where the ranks of `attempt` run, as far as they have said (rank order; a rank that has not
    started yet, or wrote something unusable, is missing)."""
    found = []
    for rank in range(world_size):
        try:
            placed = parse_placement(files.placement(rank).read_text(errors="replace"), attempt)
        except OSError:
            continue
        if placed is not None and placed.rank == rank:
            found.append(placed.model_dump())
    return found


def log_tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file, or "" when there is none."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "".join(text.splitlines(keepends=True)[-lines:]).strip()


def submitted_external_id(files: JobFiles) -> str | None:
    """The id submitit gave a job, read from its `<id>_submitted.pkl` (present once it submitted)."""
    if not files.submitit.is_dir():
        return None
    for path in files.submitit.glob(f"*{SUBMITTED_SUFFIX}"):
        return path.name[: -len(SUBMITTED_SUFFIX)]
    return None


def read_new_progress(path: Path, offset: int) -> tuple[list[ProgressRecord | CheckpointRecord], int] | None:
    """The records of the complete lines after byte `offset`, and the offset after them; None while
    there is no new complete line (rank 0 may be mid-write). Unusable lines are skipped and logged."""
    try:
        with path.open("rb") as handle:
            handle.seek(offset)
            chunk = handle.read(MAX_PROGRESS_READ)
    except FileNotFoundError:
        return None
    end = chunk.rfind(b"\n")
    if end < 0:
        return None
    records = []
    for raw in chunk[: end + 1].splitlines():
        record = parse_progress_line(raw)
        if record is not None:
            records.append(record)
        elif raw.strip():
            log.warning("skipping a progress line it cannot use: %r", raw[:200])
    return records, offset + end + 1
