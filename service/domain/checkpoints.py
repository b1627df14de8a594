"""A job's checkpoints, for its owner: the list, and one opened for download.

checkpoints/ is the job's to write, and the job is untrusted: the folder itself, a checkpoint or its
note may be a link (to a file the service can read and the job cannot), a FIFO or a folder. So every
step opens a directory handle without following links, and only regular files are listed or read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO

from sqlmodel import Session

from service.domain.auth import Principal
from service.domain.job_files import folder_below, open_job_file
from service.domain.jobs import get_job
from service.errors import NotFound
from service.ledger.models import CheckpointPublic
from worker.spec import CHECKPOINT_NOTE_SUFFIX, CHECKPOINT_PATTERN, JobFiles, parse_checkpoint_note

MAX_NOTE_BYTES = 64 * 1024


@dataclass(frozen=True)
class CheckpointDownload:
    handle: BinaryIO
    size: int
    name: str


def list_checkpoints(session: Session, job_id: int, viewer: Principal) -> list[CheckpointPublic]:
    """The job's checkpoints, oldest first (none once retention removed them)."""
    job = get_job(session, job_id, viewer)
    if job.folder is None:
        return []
    found = []
    files = JobFiles(Path(job.folder))
    with folder_below(files.folder, files.checkpoints) as folder:
        if folder is None:
            return []
        for entry in os.scandir(folder):
            match = CHECKPOINT_PATTERN.fullmatch(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            info = entry.stat(follow_symlinks=False)
            found.append(
                CheckpointPublic(
                    name=entry.name,
                    step=int(match.group(1)),
                    bytes=info.st_size,
                    saved_at=datetime.fromtimestamp(info.st_mtime, tz=timezone.utc),
                    metrics=_note_metrics(folder, entry.name),
                )
            )
    return sorted(found, key=lambda checkpoint: checkpoint.step)


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
