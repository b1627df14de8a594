"""Windows onto one rank's log: its end, or the bytes from an offset on, never the whole file."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from service.backends.base import Backend
from service.errors import InvalidRequest
from service.jobfs import NotAFile, open_log
from service.ledger.models.jobs import Job


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
    ranks = job.resources.world_size
    if not 0 <= rank < ranks:
        raise InvalidRequest(f"must be between 0 and {ranks - 1} for this job", field="rank")
    if offset is not None and tail is not None:
        raise InvalidRequest("give either tail or offset, not both", field="offset")
    if job.external_id is None or job.folder is None:
        return LogWindow("", 0, 0)
    folder = Path(job.folder)
    path = backend.log_path(folder, job.external_id, rank, stream)
    try:
        handle = open_log(folder, path)
    except NotAFile:
        raise InvalidRequest(
            "the log is not a regular file of the job folder (a link, which may lead out of it, or a FIFO)",
            field="rank",
        ) from None
    if handle is None:
        return LogWindow("", 0, 0)
    with handle:
        if offset is not None:
            return _window_at(handle, offset, max_bytes)
        size = handle.seek(0, 2)
        return LogWindow(_tail_text(handle, tail, max_bytes), size, size)


def _window_at(handle: BinaryIO, offset: int, max_bytes: int) -> LogWindow:
    size = handle.seek(0, 2)
    handle.seek(min(offset, size))
    data = handle.read(max_bytes)
    start = min(offset, size)
    if len(data) == max_bytes and b"\n" in data:  # stop at a line's end: never split a character
        data = data[: data.rindex(b"\n") + 1]
    return LogWindow(data.decode("utf-8", errors="replace"), size, start + len(data))


def _tail_text(handle: BinaryIO, tail: int | None, max_bytes: int) -> str:
    size = handle.seek(0, 2)
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
