"""Windows onto one rank's log: its end, or the bytes from an offset on, never the whole file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from service.backends.base import Backend
from service.domain.endings import world_size
from service.domain.job_files import open_job_file
from service.errors import InvalidRequest
from service.ledger.models import Job


@dataclass(frozen=True)
class LogWindow:
    text: str
    size: int  # the whole file's size in bytes
    end: int  # the byte after the last one read: where the next read starts


def read_log(
    job: Job,
    backend: Backend,
    *,
    rank: int,
    tail: int | None,
    stream: str,
    max_bytes: int,
    offset: int | None = None,
) -> LogWindow:
    """One rank's log: the last `tail` lines of its last `max_bytes`, or `max_bytes` from `offset` on.

    Only ever one window of the file is read: a log of many gigabytes costs what a small one does.
    """
    ranks = world_size(job)
    if not 0 <= rank < ranks:
        raise InvalidRequest(f"must be between 0 and {ranks - 1} for this job", field="rank")
    if offset is not None and tail is not None:
        raise InvalidRequest("give either tail or offset, not both", field="offset")
    if job.external_id is None or job.folder is None:
        return LogWindow("", 0, 0)
    folder = Path(job.folder)
    path = backend.log_path(folder, job.external_id, rank, stream)
    if not _inside(path, folder):
        raise InvalidRequest("log path escapes the job folder", field="rank")
    if not path.is_file():
        return LogWindow("", 0, 0)
    if offset is not None:
        return _window_at(path, offset, max_bytes)
    size = path.stat().st_size
    return LogWindow(_tail_text(path, tail, max_bytes), size, size)


def _window_at(path: Path, offset: int, max_bytes: int) -> LogWindow:
    with _open(path) as handle:
        size = handle.seek(0, 2)
        handle.seek(min(offset, size))
        data = handle.read(max_bytes)
    start = min(offset, size)
    if len(data) == max_bytes and b"\n" in data:  # stop at a line's end: never split a character
        data = data[: data.rindex(b"\n") + 1]
    return LogWindow(data.decode("utf-8", errors="replace"), size, start + len(data))


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
    except ValueError:
        return False
    return True


def _open(path: Path) -> BinaryIO:
    """The log, a regular file of the job's folder (never a link or a FIFO: service.domain.job_files)."""
    handle = open_job_file(path)
    if handle is None:
        raise InvalidRequest("the log is not a regular file", field="rank")
    return handle


def _tail_text(path: Path, tail: int | None, max_bytes: int) -> str:
    with _open(path) as handle:
        handle.seek(0, 2)
        size = handle.tell()
        start = max(0, size - max_bytes)
        handle.seek(max(0, start - 1))  # one byte early: does the window begin a line?
        data = handle.read(max_bytes + 1 if start > 0 else max_bytes)
    if start > 0:
        before, data = data[:1], data[1:]
        if before != b"\n":
            data = data.split(b"\n", 1)[-1]  # drop the partial first line
    text = data.decode("utf-8", errors="replace")
    if tail is not None:
        lines = text.splitlines(keepends=True)
        text = "".join(lines[-tail:]) if tail > 0 else ""
    return text
