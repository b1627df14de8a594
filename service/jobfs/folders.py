"""Whole job folders, for retention: how big one is, and removing it (or all of it but its logs).

A removal must survive the service dying half-way, and no reader may ever meet a half-deleted folder.
So nothing is deleted in place: what goes is first *renamed* into `<jobs>/.trash/` (one atomic step
per entry, on the same file system), and only the trash is deleted, by a later step that any pass
repeats until the trash is empty. A folder is whole at its name, or gone from it.

A job folder holds what an untrusted job wrote: links (to files the service may delete and the job
may not), FIFOs, folders without permissions, very deep trees. Every step works on directory handles
opened without following links; a link is renamed or unlinked as itself, never its target; a tree
deeper than MAX_DEPTH is cut into pieces moved up to the trash's top, so no recursion or handle
count grows with what the job made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from service.jobfs.handles import chmod_folder, closing, folder_handle, open_folder, service_folder
from service.jobfs.names import ATTEMPTS, LOG_NAME, SUBMITIT, TRASH

log = logging.getLogger(__name__)

MAX_DEPTH = 64


@dataclass(frozen=True)
class FolderUsage:
    total: int  # bytes on disk, the folder's own included
    logs: int  # of which the logs


def usage(folder: Path) -> FolderUsage | None:
    """What the folder takes on disk (allocated blocks, each inode once), None when it is not there."""
    try:
        fd = open_folder(folder)
    except OSError:
        return None
    with closing(fd):
        total = os.fstat(fd).st_blocks * 512 + _tree_bytes(fd, set(), 0)
        logs = sum(_regular_bytes(sub, name) for sub, name in _log_entries(fd))
    return FolderUsage(total, logs)


def move_folder_to_trash(folder: Path) -> bool:
    """Rename the whole job folder into the trash; False when it was not there (already moved)."""
    with folder_handle(folder.parent) as parent, _trash(parent) as trash:
        target = _unique(folder.name)
        try:
            os.rename(folder.name, target, src_dir_fd=parent, dst_dir_fd=trash)
        except FileNotFoundError:
            return False
        except PermissionError:  # the job took write permission off its folder (its `..` must change)
            chmod_folder(parent, folder.name)  # never the jobs folder itself: every job reaches through it
            os.rename(folder.name, target, src_dir_fd=parent, dst_dir_fd=trash)
    return True


def move_files_to_trash(folder: Path) -> bool:
    """Rename everything in the job folder but submitit's logs (the current attempt's and the archived
    ones') into the trash; False when the folder was not there."""
    with folder_handle(folder.parent) as parent, _trash(parent) as trash:
        try:
            handle = _open_directory(parent, folder.name)
        except FileNotFoundError:
            return False
        holder_name = _unique(f"{folder.name}-files")
        os.mkdir(holder_name, 0o700, dir_fd=trash)
        with closing(handle) as job, closing(_open_directory(trash, holder_name)) as holder:
            moved = iter(range(1 << 62))

            def out(parent_fd: int, name: str) -> None:
                target = str(next(moved))
                _retry_writable(
                    parent_fd, lambda: os.rename(name, target, src_dir_fd=parent_fd, dst_dir_fd=holder), name
                )

            _move_all_but_logs(job, out)
    return True


def empty_trash(jobs_root: Path) -> int:
    """Delete what the trash holds; the bytes freed. What cannot be deleted now stays for the next pass."""
    try:
        parent = open_folder(jobs_root)
    except OSError:
        return 0
    with closing(parent):
        try:  # no trash yet: nothing to empty, and nothing to make (a pass changes no folder for nothing)
            os.stat(TRASH, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return 0
        return _empty(parent)


def _empty(parent: int) -> int:
    freed = 0
    with _trash(parent) as trash:
        while names := os.listdir(trash):
            freed_before = freed
            for name in names:
                try:
                    freed += _remove(trash, name, trash, 0)
                except OSError as error:
                    log.warning("cannot delete %s from the trash yet: %s", name, error)
            if freed == freed_before and sorted(os.listdir(trash)) == sorted(names):
                break  # nothing moved this round: leave the rest to the next pass
    return freed


# ---------------------------------------------------------------- walking without following links


def _tree_bytes(fd: int, seen: set[tuple[int, int]], depth: int) -> int:
    total = 0
    for entry in os.scandir(fd):
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if (info.st_dev, info.st_ino) in seen:
            continue  # a hard link counts once
        seen.add((info.st_dev, info.st_ino))
        total += info.st_blocks * 512
        if stat.S_ISDIR(info.st_mode) and depth < MAX_DEPTH:
            try:
                child = open_folder(entry.name, fd)
            except OSError:
                continue
            with closing(child):
                total += _tree_bytes(child, seen, depth + 1)
    return total


def _log_entries(job: int) -> Iterator[tuple[int, str]]:
    """(folder handle, name) of every log file in submitit/ and attempts/<n>/submitit/ (handles valid
    while the iteration is at that entry)."""
    for submitit in _submitit_folders(job):
        with closing(submitit):
            for name in os.listdir(submitit):
                if LOG_NAME.fullmatch(name):
                    yield submitit, name


def _submitit_folders(job: int) -> Iterator[int]:
    with contextlib.suppress(OSError):
        yield _open_directory(job, SUBMITIT)
    try:
        archive = _open_directory(job, ATTEMPTS)
    except OSError:
        return
    with closing(archive):
        for attempt in os.listdir(archive):
            try:
                attempt_fd = _open_directory(archive, attempt)
            except OSError:
                continue
            with closing(attempt_fd), contextlib.suppress(OSError):
                yield _open_directory(attempt_fd, SUBMITIT)


def _regular_bytes(folder: int, name: str) -> int:
    try:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return 0
    return info.st_blocks * 512 if stat.S_ISREG(info.st_mode) else 0


def _move_all_but_logs(job: int, out: Callable[[int, str], None]) -> None:
    for name in os.listdir(job):
        if name == SUBMITIT:
            _move_all_but_logs_in(job, name, out)
        elif name == ATTEMPTS:
            try:
                archive = _open_directory(job, name)
            except OSError:
                out(job, name)
                continue
            with closing(archive):
                for attempt in os.listdir(archive):
                    try:
                        attempt_fd = _open_directory(archive, attempt)
                    except OSError:
                        out(archive, attempt)
                        continue
                    with closing(attempt_fd):
                        for inner in os.listdir(attempt_fd):
                            if inner == SUBMITIT:
                                _move_all_but_logs_in(attempt_fd, inner, out)
                            else:
                                out(attempt_fd, inner)
        else:
            out(job, name)


def _move_all_but_logs_in(parent: int, name: str, out: Callable[[int, str], None]) -> None:
    try:
        folder = _open_directory(parent, name)
    except OSError:  # a link or a file where submitit's folder should be: it goes whole
        out(parent, name)
        return
    with closing(folder):
        for inner in os.listdir(folder):
            if not (LOG_NAME.fullmatch(inner) and _is_regular(folder, inner)):
                out(folder, inner)


def _is_regular(folder: int, name: str) -> bool:
    return stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)


# ---------------------------------------------------------------- deleting without following links


def _remove(parent: int, name: str, trash: int, depth: int) -> int:
    """Delete `name` in `parent` and everything under it; the bytes freed. A folder deeper than
    MAX_DEPTH is moved up to the trash's top instead, for a later round."""
    info = os.stat(name, dir_fd=parent, follow_symlinks=False)
    freed = info.st_blocks * 512
    if not stat.S_ISDIR(info.st_mode):
        _retry_writable(parent, lambda: os.unlink(name, dir_fd=parent))
        return freed
    if depth >= MAX_DEPTH:
        _retry_writable(
            parent, lambda: os.rename(name, _unique("deep"), src_dir_fd=parent, dst_dir_fd=trash), name
        )
        return 0
    with closing(_open_directory(parent, name)) as folder:
        for inner in os.listdir(folder):
            freed += _remove(folder, inner, trash, depth + 1)
    _retry_writable(parent, lambda: os.rmdir(name, dir_fd=parent))
    return freed


def _retry_writable(folder: int, step: Callable[[], None], moving: str | None = None) -> None:
    """Run `step`; when permissions refuse it (a job may chmod its own folders), make the folder, and
    the folder `moving` out of it (a folder's `..` changes when it moves), the service's to write and
    try once more. Root never needs this."""
    try:
        step()
    except PermissionError:
        os.fchmod(folder, 0o700)
        if moving is not None and stat.S_ISDIR(os.stat(moving, dir_fd=folder, follow_symlinks=False).st_mode):
            chmod_folder(folder, moving)
        step()


def _open_directory(parent: int, name: str) -> int:
    """A handle on folder `name` in `parent`, never through a link. A folder the job made unreadable
    is made readable again first (through a handle, so a link swapped in meanwhile is not followed)."""
    try:
        return open_folder(name, parent)
    except PermissionError:
        chmod_folder(parent, name)
        return open_folder(name, parent)


@contextlib.contextmanager
def _trash(jobs_root: int) -> Iterator[int]:
    """The trash folder in the jobs folder: the service's own, mode 0700 (no job can reach into it)."""
    with closing(service_folder(jobs_root, TRASH, 0o700, "jobs folder")) as fd:
        yield fd


def _unique(stem: str) -> str:
    return f"{stem}.{uuid.uuid4().hex[:12]}"
