"""What the ranks write for the service to see inside a running job (worker.stacks): their stacks
files (appended to by faulthandler on SIGURG), activity files, and NCCL flight recorder dumps.

Written by untrusted code, like every file of the job's folder: the `stacks/` and `activity/`
folders are walked to with no link followed (folder_below), a file is read only when it is a
regular file (open_file), and every read is bounded: a stacks file only from the size noted
before the signal, at most `limit_bytes` of it; an activity file 4 KiB; a dump 1 MiB, and no more
than MAX_DUMPS_BYTES for a whole job. Text is cleaned (no NUL, no lone surrogate) before it leaves.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from service.jobfs.handles import entry, folder_below, open_file
from worker.spec import JobFiles, RankActivity, clean_text, parse_activity

STACKS_LIMIT_BYTES = 64 * 1024  # of one rank's stacks, read after the size noted
MAX_ACTIVITY_BYTES = 4096
MAX_DUMP_BYTES = 1024 * 1024  # of one rank's flight recorder dump: a larger one is not read
MAX_DUMPS_BYTES = 32 * 1024 * 1024  # of all ranks' dumps in one read
MAX_RANKS = 4096  # ranks looked at in one read: a world size says how many files to open


@dataclass(frozen=True)
class StackText:
    """What one rank appended to its stacks file since the size noted."""

    text: str  # cleaned; "" when nothing was appended
    cut: bool = False  # more was appended than was read (limit_bytes): the text is the end of it
    restarted: bool = False  # the file was shorter than noted (replaced): read from its start


def stack_sizes(folder: Path, world: int) -> dict[int, int]:
    """The size of each rank's stacks file (ranks below `world`), 0 for one not there yet (the rank
    has not started): note them before signalling, and read only what comes after. A rank whose
    name holds anything but a regular file (a link, a FIFO) is left out: it is not read."""
    files = JobFiles(folder)
    sizes: dict[int, int] = {}
    with folder_below(folder, files.stacks(0).parent) as handle:
        for rank in range(min(world, MAX_RANKS)):
            if handle is None:
                sizes[rank] = 0
                continue
            info = entry(files.stacks(rank).name, handle)
            if info is None:
                sizes[rank] = 0
            elif stat.S_ISREG(info.st_mode):
                sizes[rank] = info.st_size
    return sizes


def read_stack_texts(folder: Path, sizes: dict[int, int],
                     limit_bytes: int = STACKS_LIMIT_BYTES) -> dict[int, StackText]:
    """What each rank of `sizes` appended to its stacks file after its noted size: at most
    `limit_bytes` (the last ones, when more was appended), from regular files only (a rank whose
    file is missing, a link or a FIFO is left out), decoded leniently and cleaned."""
    files = JobFiles(folder)
    found: dict[int, StackText] = {}
    with folder_below(folder, files.stacks(0).parent) as handle:
        if handle is None:
            return found
        for rank, size in list(sizes.items())[:MAX_RANKS]:
            read = _read_after(open_file(files.stacks(rank).name, dir_fd=handle), max(size, 0), limit_bytes)
            if read is not None:
                found[rank] = read
    return found


def read_stacks_after(folder: Path, sizes: dict[int, int],
                      limit_bytes: int = STACKS_LIMIT_BYTES) -> dict[int, str]:
    """read_stack_texts' texts alone."""
    return {rank: read.text for rank, read in read_stack_texts(folder, sizes, limit_bytes).items()}


def _read_after(handle: BinaryIO | None, size: int, limit_bytes: int) -> StackText | None:
    """The bytes after `size` when they are at most `limit_bytes`; else their last `limit_bytes`
    from a line's start: faulthandler writes the main thread last, and it is the one that matters."""
    if handle is None:
        return None
    try:
        with handle:
            now = os.fstat(handle.fileno()).st_size
            restarted = now < size
            start = 0 if restarted else size
            cut = now - start > limit_bytes
            handle.seek(now - limit_bytes if cut else start)
            raw = handle.read(limit_bytes)
    except OSError:
        return None
    if cut:
        raw = raw[raw.find(b"\n") + 1 :]  # from the first whole line (all of it when there is none)
    text = clean_text(raw.decode("utf-8", errors="replace"))
    return StackText(text=text, cut=cut, restarted=restarted)


def read_activity(folder: Path, world: int, attempt: int | None = None) -> list[RankActivity]:
    """The ranks' activity records (rank order), of `attempt` when given; a rank with no usable file
    (not started, torn, a link, another attempt's, naming another rank) is missing."""
    files = JobFiles(folder)
    found: list[RankActivity] = []
    with folder_below(folder, files.activity(0).parent) as handle:
        if handle is None:
            return found
        for rank in range(min(world, MAX_RANKS)):
            raw = _read_all(open_file(files.activity(rank).name, dir_fd=handle), MAX_ACTIVITY_BYTES)
            record = parse_activity(raw.decode("utf-8", errors="replace")) if raw is not None else None
            if record is not None and record.rank == rank and attempt in (None, record.attempt):
                found.append(record)
    return found


def read_flight_records(folder: Path, world: int, since: float | None = None) -> dict[int, bytes]:
    """The NCCL flight recorder dumps of ranks below `world` (written at or after `since`, seconds
    since the epoch, when given: an NCCL rank dumps within a second of each capture of its stacks,
    and on a collective's timeout), as bytes to parse with service.domain.stacks.parse_flight_recorder:
    regular files of at most MAX_DUMP_BYTES (a larger one would be cut, and a cut pickle is no dump),
    MAX_DUMPS_BYTES in all."""
    files = JobFiles(folder)
    found: dict[int, bytes] = {}
    total = 0
    with folder_below(folder, files.flight_recorder(0).parent) as handle:
        if handle is None:
            return found
        for rank in range(min(world, MAX_RANKS)):
            name = files.flight_recorder(rank).name
            if since is not None and ((info := entry(name, handle)) is None or info.st_mtime < since):
                continue
            data = _read_all(open_file(name, dir_fd=handle), MAX_DUMP_BYTES)
            if data is None or not data or total + len(data) > MAX_DUMPS_BYTES:
                continue
            found[rank] = data
            total += len(data)
    return found


def _read_all(handle: BinaryIO | None, most: int) -> bytes | None:
    """The whole file when it is at most `most` bytes, else None."""
    if handle is None:
        return None
    try:
        with handle:
            data = handle.read(most + 1)
    except OSError:
        return None
    return data if len(data) <= most else None
