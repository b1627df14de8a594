"""Rank 0's checkpoints in a job's folder, read for their owner: a bounded page of them, and one opened.

checkpoints/ is the job's to write, and the job is untrusted: the folder itself, a checkpoint or its
note may be a link (to a file the service can read and the job cannot), a FIFO or a folder. So every
step opens a directory handle without following links, and only regular files are listed or read.

The folder may also hold more names than anyone could want listed: hard links to one empty file and
a note under each cost the job nothing, and a list built from all of them (each stat-ed, each note
read, all sorted) would cost the service gigabytes. So a page costs a bounded walk: at most
MAX_SCANNED_NAMES names are read from the folder (the answer says when it stopped there), each name
is parsed for its step without a stat, only the page's entries are kept (a heap), and only those are
stat-ed and have their notes read. A checkpoint is listed only with its note beside it: the one rule
(worker.spec.checkpoint_is_whole) by which a restart resumes only from a checkpoint written whole.
"""

from __future__ import annotations

import heapq
import itertools
import os
import stat
from dataclasses import dataclass
from typing import BinaryIO

from service.jobfs.handles import entry, folder_below, open_file
from worker.spec import (
    CHECKPOINT_NOTE_SUFFIX,
    CHECKPOINT_PATTERN,
    JobFiles,
    checkpoint_is_whole,
    checkpoint_note_name,
    parse_checkpoint_note,
)

MAX_NOTE_BYTES = 64 * 1024
MAX_SCANNED_NAMES = 100_000  # names read from checkpoints/ per request, checkpoints, notes and others

Key = tuple[int, str]  # (step, name): the order of the list; the name tells two spellings of a step apart


@dataclass(frozen=True)
class CheckpointFile:
    name: str
    step: int
    bytes: int
    mtime: float
    metrics: dict[str, float | None]  # as its note says (none without one)


@dataclass(frozen=True)
class Scan:
    keys: list[Key]  # the first checkpoints past the one asked for, in the order asked for
    files: list[CheckpointFile]  # the first of them that are still regular files, stat-ed now
    cut_at: int | None  # MAX_SCANNED_NAMES when the folder held more names than were read


def checkpoint_key(name: str) -> Key | None:
    match = CHECKPOINT_PATTERN.fullmatch(name)
    return (int(match.group(1)), name) if match is not None else None


def scan_checkpoints(
    files: JobFiles, most: int, described: int, past: Key | None, newest_first: bool
) -> Scan | None:
    """The first `most` checkpoints past `past` (oldest first, or newest first), the first `described`
    of them stat-ed and their notes read; None when the job has no checkpoints folder (or a link)."""
    with folder_below(files.folder, files.checkpoints) as folder:
        if folder is None:
            return None
        keys, cut = _choose(folder, most, past, newest_first)
        found = [one for key in keys[:described] if (one := _checkpoint(folder, *key)) is not None]
    return Scan(keys, found, MAX_SCANNED_NAMES if cut else None)


def _choose(folder: int, most: int, past: Key | None, newest_first: bool) -> tuple[list[Key], bool]:
    """The first `most` whole checkpoints past `past` in the list's order, from the folder's first
    MAX_SCANNED_NAMES names, and whether there were more names. Names only: no stat (scandir knows a
    regular file from its directory entry), no note read. Whole is worker.spec's one rule: the note
    is there (rank 0 writes it once the file is complete), so a checkpoint half written is not listed."""
    notes = _NoteNames(folder)
    with os.scandir(folder) as entries:
        keys = (key for entry in itertools.islice(entries, MAX_SCANNED_NAMES)
                if (key := _entry_key(entry)) and checkpoint_is_whole(key[1], notes))  # fmt: skip
        if past is not None:
            keys = (key for key in keys if (key < past if newest_first else key > past))
        chosen = heapq.nlargest(most, keys) if newest_first else heapq.nsmallest(most, keys)
        cut = next(entries, None) is not None
    return chosen, cut


class _NoteNames:
    """The notes among the folder's first MAX_SCANNED_NAMES names, read in a pass of their own. Kept
    as hashes: a few MB at most, where the names themselves (up to 255 bytes each) could be tens; a
    collision would only list one of the job's own checkpoints that has no note."""

    def __init__(self, folder: int) -> None:
        with os.scandir(folder) as entries:  # a handle's scandir starts from the top each time
            self._hashes = {hash(entry.name) for entry in itertools.islice(entries, MAX_SCANNED_NAMES)
                            if entry.name.endswith(CHECKPOINT_NOTE_SUFFIX)}  # fmt: skip

    def __contains__(self, name: object) -> bool:
        return hash(name) in self._hashes


def _entry_key(entry: os.DirEntry[str]) -> Key | None:
    key = checkpoint_key(entry.name)
    return key if key is not None and entry.is_file(follow_symlinks=False) else None


def _checkpoint(folder: int, step: int, name: str) -> CheckpointFile | None:
    """One entry of the page, stat-ed now; None when it went, or is no longer a regular file."""
    info = entry(name, folder)
    if info is None or not stat.S_ISREG(info.st_mode):
        return None
    return CheckpointFile(name, step, info.st_size, info.st_mtime, _note_metrics(folder, name))


def _note_metrics(folder: int, checkpoint: str) -> dict[str, float | None]:
    handle = open_file(checkpoint_note_name(checkpoint), dir_fd=folder)
    if handle is None:
        return {}
    try:
        with handle:
            return parse_checkpoint_note(handle.read(MAX_NOTE_BYTES).decode("utf-8", errors="replace"))
    except OSError:
        return {}


def open_checkpoint_file(files: JobFiles, name: str) -> BinaryIO | None:
    """The checkpoint `name` opened for reading (the caller closes it); None unless it is a regular file
    named as a checkpoint, in a checkpoints folder that is no link."""
    if CHECKPOINT_PATTERN.fullmatch(name) is None:
        return None
    with folder_below(files.folder, files.checkpoints) as folder:
        return open_file(name, dir_fd=folder) if folder is not None else None
