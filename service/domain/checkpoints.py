"""A job's checkpoints, for its owner: the list, a page at a time, and one opened for download.

The folder is the job's to write, and may hold links, FIFOs and more names than anyone could want
listed: reading it is service.jobfs.checkpoints's (no link followed, only regular files, a bounded
walk of the folder whose cost does not grow with what the job made). This module decides who may
see which page.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from sqlmodel import Session

from service import jobfs
from service.domain.auth import Principal
from service.domain.jobs import get_job
from service.errors import InvalidRequest, NotFound
from service.ledger.models.jobs import CheckpointPublic
from worker.spec import JobFiles

DEFAULT_PAGE = 100
MAX_PAGE = 1000


@dataclass(frozen=True)
class CheckpointDownload:
    handle: BinaryIO
    size: int
    name: str


@dataclass(frozen=True)
class CheckpointPage:
    items: list[CheckpointPublic]
    next_after: str | None  # the name to pass as `after` for the next page; None on the last page
    cut_at: int | None  # how many names were read when the folder held more (jobfs's MAX_SCANNED_NAMES)


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
    past = jobfs.checkpoint_key(after) if after is not None else None
    if after is not None and past is None:
        raise InvalidRequest("is not a checkpoint's name (ckpt-<n>.pt)", field="after")
    # One more than the page: whether another page follows.
    scan = jobfs.scan_checkpoints(JobFiles(Path(job.folder)), limit + 1, limit, past, newest_first)
    if scan is None:
        return empty
    items = [
        CheckpointPublic(
            name=found.name,
            step=found.step,
            bytes=found.bytes,
            saved_at=datetime.fromtimestamp(found.mtime, tz=timezone.utc),
            metrics=found.metrics,
        )
        for found in scan.files
    ]
    next_after = scan.keys[limit - 1][1] if len(scan.keys) > limit else None
    return CheckpointPage(items, next_after, scan.cut_at)


def open_checkpoint(session: Session, job_id: int, viewer: Principal, name: str) -> CheckpointDownload:
    """One checkpoint opened for reading (the caller closes it); NotFound unless it is a regular file."""
    job = get_job(session, job_id, viewer)
    handle = jobfs.open_checkpoint_file(JobFiles(Path(job.folder)), name) if job.folder is not None else None
    if handle is None:
        raise NotFound(f"job {job_id} has no checkpoint {name}", field="checkpoint")
    return CheckpointDownload(handle, os.fstat(handle.fileno()).st_size, name)
