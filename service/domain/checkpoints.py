"""A job's checkpoints, for its owner: the list, and one opened for download.

checkpoints/ is the job's to write, and the job is untrusted: the folder itself, a checkpoint or its
note may be a link (to a file the service can read and the job cannot), a FIFO or a folder. So every
step opens a directory handle without following links, and only regular files are listed or read.

The folder may also hold more names than anyone could want listed: hard links to one empty file and
a note under each cost the job nothing, and a list built from all of them (each stat-ed, each note
read, all sorted) would cost the service gigabytes. So the list is paged, and a page costs a bounded
walk: at most MAX_SCANNED_NAMES names are read from the folder (the answer says when it stopped
there), each name is parsed for its step without a stat, only the page's entries are kept (a heap of
`limit` + 1), and only those are stat-ed and have their notes read.
"""

from __future__ import annotations

import heapq
import itertools
import os
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from sqlmodel import Session

from service.domain.auth import Principal
from service.domain.job_files import folder_below, open_job_file
from service.domain.jobs import get_job
from service.errors import InvalidRequest, NotFound
from service.ledger.models import CheckpointPublic
from worker.spec import CHECKPOINT_NOTE_SUFFIX, CHECKPOINT_PATTERN, JobFiles, parse_checkpoint_note

MAX_NOTE_BYTES = 64 * 1024
DEFAULT_PAGE = 100
MAX_PAGE = 1000
MAX_SCANNED_NAMES = 100_000  # names read from checkpoints/ per request, checkpoints, notes and others

Key = tuple[int, str]  # (step, name): the order of the list; the name tells two spellings of a step apart


@dataclass(frozen=True)
class CheckpointDownload:
    handle: BinaryIO
    size: int
    name: str


@dataclass(frozen=True)
class CheckpointPage:
    items: list[CheckpointPublic]
    next_after: str | None  # the name to pass as `after` for the next page; None on the last page
    cut_at: int | None  # MAX_SCANNED_NAMES when the folder held more names than were read


def list_checkpoints(
    session: Session,
    job_id: int,
    viewer: Principal,
    *,
    limit: int = DEFAULT_PAGE,
    after: str | None = None,
    newest_first: bool = False,
) -> CheckpointPage:
    """One page of the job's checkpoints, oldest first (or newest first), those past the checkpoint
    named `after` in that order (none once retention removed them)."""
    job = get_job(session, job_id, viewer)
    empty = CheckpointPage([], None, None)
    if job.folder is None:
        return empty
    past = _key(after) if after is not None else None
    if after is not None and past is None:
        raise InvalidRequest("is not a checkpoint's name (ckpt-<n>.pt)", field="after")
    files = JobFiles(Path(job.folder))
    with folder_below(files.folder, files.checkpoints) as folder:
        if folder is None:
            return empty
        chosen, cut = _choose(folder, limit + 1, past, newest_first)
        items = [found for key in chosen[:limit] if (found := _checkpoint(folder, *key)) is not None]
    next_after = chosen[limit - 1][1] if len(chosen) > limit else None
    return CheckpointPage(items, next_after, MAX_SCANNED_NAMES if cut else None)


def _choose(folder: int, most: int, past: Key | None, newest_first: bool) -> tuple[list[Key], bool]:
    """The first `most` checkpoints past `past` in the list's order, from the folder's first
    MAX_SCANNED_NAMES names, and whether there were more names. Names only: no stat (scandir knows a
    regular file from its directory entry), no note read."""
    with os.scandir(folder) as entries:
        keys = (key for entry in itertools.islice(entries, MAX_SCANNED_NAMES) if (key := _entry_key(entry)))
        if past is not None:
            keys = (key for key in keys if (key < past if newest_first else key > past))
        chosen = heapq.nlargest(most, keys) if newest_first else heapq.nsmallest(most, keys)
        cut = next(entries, None) is not None
    return chosen, cut


def _entry_key(entry: os.DirEntry[str]) -> Key | None:
    key = _key(entry.name)
    return key if key is not None and entry.is_file(follow_symlinks=False) else None


def _key(name: str) -> Key | None:
    match = CHECKPOINT_PATTERN.fullmatch(name)
    return (int(match.group(1)), name) if match is not None else None


def _checkpoint(folder: int, step: int, name: str) -> CheckpointPublic | None:
    """One entry of the page, stat-ed now; None when it went, or is no longer a regular file."""
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    return CheckpointPublic(
        name=name,
        step=step,
        bytes=info.st_size,
        saved_at=datetime.fromtimestamp(info.st_mtime, tz=timezone.utc),
        metrics=_note_metrics(folder, name),
    )


def open_checkpoint(session: Session, job_id: int, viewer: Principal, name: str) -> CheckpointDownload:
    """One checkpoint opened for reading (the caller closes it); NotFound unless it is a regular file."""
    job = get_job(session, job_id, viewer)
    missing = NotFound(f"job {job_id} has no checkpoint {name}", field="checkpoint")
    if job.folder is None or CHECKPOINT_PATTERN.fullmatch(name) is None:
        raise missing
    files = JobFiles(Path(job.folder))
    with folder_below(files.folder, files.checkpoints) as folder:
        handle = open_job_file(name, dir_fd=folder) if folder is not None else None
    if handle is None:
        raise missing
    return CheckpointDownload(handle, os.fstat(handle.fileno()).st_size, name)


def _note_metrics(folder: int, checkpoint: str) -> dict[str, float | None]:
    handle = open_job_file(checkpoint.removesuffix(".pt") + CHECKPOINT_NOTE_SUFFIX, dir_fd=folder)
    if handle is None:
        return {}
    try:
        with handle:
            return parse_checkpoint_note(handle.read(MAX_NOTE_BYTES).decode("utf-8", errors="replace"))
    except OSError:
        return {}
