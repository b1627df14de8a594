"""Restarts in place, as the job folder holds them: the supervisor's restarts.jsonl read incrementally
(bounded, each line through the worker's one parser) and the service's restart-request.json written
atomically (a new file renamed over the old, never through a link) and read back.

The supervisor runs as the job's account, so restarts.jsonl is as untrusted as anything the job
writes: a line may be huge, torn, NUL-laden or about another attempt. What is not a usable record is
skipped here; which attempt a record is about is the caller's business."""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from service.jobfs.handles import folder_handle, new_file
from service.jobfs.reads import read_job_file, read_new_lines
from worker.spec import JobFiles, RestartRecord, RestartRequest, parse_restart_line, parse_restart_request

log = logging.getLogger(__name__)

MAX_RESTARTS_READ = 256 * 1024  # one read takes at most this much; the rest waits for the next
MAX_RESTART_LINE = 16 * 1024  # a longer line is no record of the supervisor's: skipped whole
MAX_RESTARTS_PER_READ = 256
MAX_REQUEST_BYTES = 4096
READABLE = 0o644  # the supervisor (the job's account) reads it


def read_new_restarts(path: Path, offset: int) -> tuple[list[RestartRecord], int] | None:
    """The records of the complete lines after byte `offset` of restarts.jsonl `path`, and the offset
    after them; None while there is no new complete line. A line longer than MAX_RESTART_LINE is
    skipped, even one longer than a whole read (it is passed over up to its end)."""
    lines = read_new_lines(path, offset, MAX_RESTARTS_READ)
    if lines is None:
        return None
    records: list[RestartRecord] = []
    skipped = used = 0
    for raw in lines:
        used += len(raw)
        record = parse_restart_line(raw) if len(raw) <= MAX_RESTART_LINE else None
        if record is not None:
            records.append(record)
        elif raw.strip():
            skipped += 1
        if len(records) >= MAX_RESTARTS_PER_READ:
            break
    if skipped:  # once per read
        log.warning("%s: skipped %d restart line(s) it cannot use", path, skipped)
    return records, offset + used


def read_restart_request(files: JobFiles) -> RestartRequest | None:
    """The request the service last wrote (None: none, or not one the parser takes)."""
    text = read_job_file(files.folder, files.restart_request, MAX_REQUEST_BYTES)
    return parse_restart_request(text) if text is not None else None


def write_restart_request(files: JobFiles, request: RestartRequest) -> None:
    """Replace restart-request.json at once: the supervisor reads either the old request or the whole
    new one. Written as a new file (no link, never over a file) and renamed over the old name in the
    job's folder by handle (a link there is replaced, never followed)."""
    data = request.model_dump_json().encode()
    temporary = f".{files.restart_request.name}.{uuid.uuid4().hex}"
    with folder_handle(files.folder) as folder:
        with new_file(temporary, READABLE, dir_fd=folder) as out:
            out.write(data)
        try:
            os.rename(temporary, files.restart_request.name, src_dir_fd=folder, dst_dir_fd=folder)
        except OSError:
            os.unlink(temporary, dir_fd=folder)
            raise
