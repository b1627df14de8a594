"""Everything the service reads from a job's folder: result, error files, placement, progress, logs'
tails and the id submitit gave it. The file names and formats are the worker's contract (worker.spec);
the folder is written by untrusted code, so every reader here takes whatever it finds without failing,
reads a bounded part of it, and cleans what it keeps (worker.spec's clean_text, ascii_int, storable)
before it nears the ledger.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from service.jobfs.handles import entry, folder_below, names, open_below, open_file, stands
from service.jobfs.names import SUBMITTED_SUFFIX, is_external_id
from worker.spec import (
    CheckpointRecord,
    JobFiles,
    ProgressRecord,
    ascii_int,
    clean_text,
    parse_error_text,
    parse_placement,
    parse_progress_line,
    storable,
)

log = logging.getLogger(__name__)

MAX_PROGRESS_READ = 4 * 1024 * 1024  # one tick reads at most this much; the rest waits for the next


MAX_RESULT_BYTES = 16 * 1024 * 1024
MAX_ERROR_BYTES = 1024 * 1024  # of a log file, for its tail
MAX_PLACEMENT_BYTES = 4096
# A job makes as many files in its folder as it likes (sparse ones cost it no disk), and the service
# looks at every running job's folder every tick: a look reads a bounded part of it.
MAX_FOLDER_ENTRIES = 4096  # names looked at in one listing of a job's folder
MAX_ERROR_FILES = 256  # error files read in one look (the ranks after them are not heard)
ERROR_HEAD_BYTES = 64  # an error file's first line: `attempt: <n>`
ERROR_TAIL_BYTES = 8192  # and its end, where a traceback names the exception
MAX_REASON_TEXT = 4000  # of a traceback or log tail that reaches a job's reason


class NotAFile(Exception):
    """Something stands at a name the service reads that is no regular file of the job's folder."""


def read_job_file(folder: Path, path: Path, most: int) -> str | None:
    """The first `most` bytes of a regular file below the job's `folder`, as text; None for anything
    else."""
    return _read(open_below(folder, path), most)


def result_written(files: JobFiles) -> bool:
    """Whether anything stands at rank 0's result.json (one stat, no read): a look between ticks.
    What it holds is read_result's to say."""
    return stands(files.result)


def read_result(files: JobFiles, attempt: int | None) -> dict[str, Any] | None:
    """Rank 0's result.json of `attempt` (any attempt's when None: a job older than that column),
    made storable: a job may write any JSON there, NaN and lone surrogates included, and the ledger row
    must still be servable to every reader."""
    text = read_job_file(files.folder, files.result, MAX_RESULT_BYTES)
    try:
        value = json.loads(text) if text is not None else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or "value" not in value:
        return None
    if attempt is not None and value.get("attempt") != attempt:
        return None  # an earlier attempt's: not this one's to end
    cleaned: dict[str, Any] = storable(value)
    return cleaned


@dataclass(frozen=True)
class RankError:
    rank: int
    text: str  # the traceback, or what the rank wrote instead
    written: float  # when (the file's mtime)


def rank_errors(files: JobFiles, attempt: int | None, world_size: int) -> list[RankError]:
    """The error files of `attempt` (files that name another are an earlier run's) of ranks below
    `world_size`, the first written first: it is the cause; ranks that fail after it usually fail
    *because* of it (their peer vanished). Bounded: at most MAX_ERROR_FILES files, each read only at
    its head and its last ERROR_TAIL_BYTES, whatever size the job made them."""
    found: list[RankError] = []
    with folder_below(files.folder, files.folder) as handle:
        for rank in _error_ranks(files, handle, world_size):
            assert handle is not None  # a rank was listed in it
            read = _head_and_tail(open_file(files.error(rank).name, dir_fd=handle))
            if read is None:
                continue
            raw, written = read
            wrote_for, text = parse_error_text(raw)
            text = clean_text(text).strip()
            if text and (attempt is None or wrote_for in (None, attempt)):
                found.append(RankError(rank, text, written))
    return sorted(found, key=lambda error: (error.written, error.rank))


def error_ranks(files: JobFiles, world_size: int) -> list[int]:
    """The ranks below `world_size` that have an error file in the job's folder (of its first
    MAX_FOLDER_ENTRIES names; at most MAX_ERROR_FILES of them)."""
    with folder_below(files.folder, files.folder) as handle:
        return _error_ranks(files, handle, world_size)


def _error_ranks(files: JobFiles, handle: int | None, world_size: int) -> list[int]:
    ranks: list[int] = []
    for name in names(handle, MAX_FOLDER_ENTRIES):
        rank = ascii_int(name.removeprefix("error-rank").removesuffix(".txt"))
        # The name as the worker writes it: "error-rank007.txt" is nobody's.
        if rank is not None and rank < world_size and name == files.error(rank).name:
            ranks.append(rank)
            if len(ranks) >= MAX_ERROR_FILES:
                break
    return sorted(ranks)


def _head_and_tail(handle: BinaryIO | None) -> tuple[str, float] | None:
    """An error file's first line and its last ERROR_TAIL_BYTES (all of it when small), as text, and
    when it was written; None for anything but a regular file."""
    if handle is None:
        return None
    try:
        with handle:
            info = os.fstat(handle.fileno())
            if info.st_size <= ERROR_HEAD_BYTES + ERROR_TAIL_BYTES:
                raw = handle.read(ERROR_HEAD_BYTES + ERROR_TAIL_BYTES)
            else:
                head = handle.read(ERROR_HEAD_BYTES).partition(b"\n")[0]
                handle.seek(info.st_size - ERROR_TAIL_BYTES)
                raw = head + b"\n...\n" + handle.read(ERROR_TAIL_BYTES)
    except OSError:
        return None
    return raw.decode("utf-8", errors="replace"), info.st_mtime


def read_placement(files: JobFiles, attempt: int, world_size: int) -> list[dict[str, Any]]:
    """Where the ranks of `attempt` run, as far as they have said (rank order; a rank that has not
    started yet, or wrote something unusable, is missing)."""
    found: list[dict[str, Any]] = []
    with folder_below(files.folder, files.placement(0).parent) as handle:
        if handle is None:
            return found
        for rank in range(world_size):
            text = _read(open_file(files.placement(rank).name, dir_fd=handle), MAX_PLACEMENT_BYTES)
            placed = parse_placement(text, attempt) if text is not None else None
            if placed is not None and placed.rank == rank:
                found.append(placed.model_dump())
    return found


def _read(handle: BinaryIO | None, most: int) -> str | None:
    if handle is None:
        return None
    try:
        with handle:
            return handle.read(most).decode("utf-8", errors="replace")
    except OSError:
        return None


def log_tail(folder: Path, path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file below the job's `folder` (of its first MiB), or "" when
    there is none."""
    text = read_job_file(folder, path, MAX_ERROR_BYTES) or ""
    return clean_text("".join(text.splitlines(keepends=True)[-lines:]).strip())[-MAX_REASON_TEXT:]


def open_log(folder: Path, path: Path) -> BinaryIO | None:
    """A log file below the job's `folder` opened for reading (the caller bounds what it reads);
    None when there is none. NotAFile when something else stands at its name: a link, which may lead
    out of the folder, or a FIFO."""
    handle = open_below(folder, path)
    if handle is None and stands(path):
        raise NotAFile(path)
    return handle


def submitted_external_id(files: JobFiles) -> str | None:
    """The id submitit gave a job, read from its `<id>_submitted.pkl` (present once it submitted).

    The service made that file; the job's account could plant one named after another user's job,
    which the service would then poll and cancel as this job's. So a name counts only on a file the
    service owns, in a submitit folder that is no link (with jobs run as the service's own account,
    nothing keeps them apart anyway), and only a name of an id's shape (is_external_id): the job's
    account can rename the service's file, to `--user=bob_submitted.pkl` say."""
    with folder_below(files.folder, files.submitit) as handle:
        if handle is None:
            return None
        for name in names(handle, MAX_FOLDER_ENTRIES):
            external_id = name.removesuffix(SUBMITTED_SUFFIX)
            if external_id != name and is_external_id(external_id) and _service_file(name, handle):
                return external_id
    return None


def _service_file(name: str, folder: int) -> bool:
    info = entry(name, folder)
    return info is not None and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid()


def read_new_lines(path: Path, offset: int, most: int) -> list[bytes] | None:
    """The complete lines after byte `offset` of the job's append-only file `path` (at most `most`
    bytes read), each with its newline; None while no new line is complete (the writer may be
    mid-line). A line longer than a whole read comes back as that read alone, without a newline, for
    the caller to skip like any unusable line: no writer's line may hold the reader in place. The
    caller's new offset is `offset` plus the lengths of the lines it used."""
    handle = open_file(path)
    if handle is None:
        return None
    try:
        with handle:
            handle.seek(offset)
            chunk = handle.read(most)
    except OSError:
        return None
    end = chunk.rfind(b"\n")
    if end < 0:
        return [chunk] if len(chunk) >= most else None
    return chunk[: end + 1].splitlines(keepends=True)


def read_new_progress(
    path: Path, offset: int, most_metrics: int
) -> tuple[list[ProgressRecord | CheckpointRecord], int] | None:
    """The records of the complete lines after byte `offset` of rank 0's progress file `path`, and the
    offset after them; None while there is no new complete line (rank 0 may be mid-write). At most
    MAX_PROGRESS_READ bytes, and the lines up to the one that brings the metric values read to
    `most_metrics`: the rest waits for a later read. Unusable lines are skipped and logged."""
    lines = read_new_lines(path, offset, MAX_PROGRESS_READ)
    if lines is None:
        return None
    records: list[ProgressRecord | CheckpointRecord] = []
    unusable: list[bytes] = []
    metrics = used = 0
    for raw in lines:
        used += len(raw)
        record = parse_progress_line(raw) if raw.endswith(b"\n") else None
        if record is not None:
            records.append(record)
            metrics += len(record.metrics) if isinstance(record, ProgressRecord) else 0
        elif raw.strip():
            unusable.append(raw)
        if metrics >= most_metrics:
            break
    if unusable:  # once per read: a job can write a million of them
        log.warning(
            "%s: skipped %d progress line(s) it cannot use, e.g. %r", path, len(unusable), unusable[0][:200]
        )
    return records, offset + used
