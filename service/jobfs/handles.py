"""Handles on a job's folder and on what is in it, opened without following a link: the one place that
spells O_NOFOLLOW, so the one place to review how the service (root in production) steps into a
folder an untrusted job writes.

A job's account owns its folder, and a job of that account still running can swap any name in it
for a link (to a secret the service can read and the job cannot, or to another job's folder), a
FIFO (an open would block the reading thread for ever) or a folder, at any moment. So:
- a folder is opened as a handle that is no link, and everything below it is reached from that
  handle, one step at a time, none a link either (`folder_below`);
- a file is read only when it is a regular file, opened without following a link and without
  blocking (`open_file`);
- a file the service writes is new (O_EXCL: never over a file) and no link (`new_file`);
- renames and removals name entries relative to a handle: a link is renamed or removed as itself,
  never its target;
- a folder the service keeps inside one of the job's (`attempts/`, the trash) is made by the
  service and checked to be its own (`service_folder`): a job's planted folder of that name fails.
The folders above a job's folder are the service's: checking the last step of its path is enough.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

_FOLDER_NO_LINK = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_FOLDER_PATH_NO_LINK = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW  # no read permission needed
_READ_NO_LINK = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


@contextlib.contextmanager
def closing(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def open_folder(path: Path | str, parent: int | None = None) -> int:
    """A handle on the folder `path` (relative to the folder handle `parent` when given), which must
    not be a link (OSError otherwise). The caller closes it."""
    return os.open(path, _FOLDER_NO_LINK, dir_fd=parent)


@contextlib.contextmanager
def folder_handle(folder: Path) -> Iterator[int]:
    """A handle on `folder`, which must not be a link (OSError otherwise)."""
    with closing(open_folder(folder)) as fd:
        yield fd


@contextlib.contextmanager
def folder_below(folder: Path, path: Path) -> Iterator[int | None]:
    """A handle on the folder `path`, the job's `folder` or one below it, walked from `folder` with no
    link followed on the way: the job can swap a folder of its own (`placement/`, `submitit/`,
    `checkpoints/`) for a link to another job's, which the service could read and it could not. None
    when a step is missing or a link, or `path` is not below `folder`."""
    try:
        steps = path.relative_to(folder).parts
    except ValueError:
        steps = ("..",)
    handle: int | None = None
    if ".." not in steps:
        try:
            handle = open_folder(folder)
            for step in steps:
                inner = open_folder(step, handle)
                os.close(handle)
                handle = inner
        except OSError:  # a step missing, or a link
            if handle is not None:
                os.close(handle)
            handle = None
    try:
        yield handle
    finally:
        if handle is not None:
            os.close(handle)


def open_file(path: Path | str, dir_fd: int | None = None) -> BinaryIO | None:
    """`path` (relative to the folder handle `dir_fd` when given) opened for reading if it is a regular
    file, else None. The job wrote its folder: a name the service reads may be a link (to a secret
    the service can read and the job cannot), a FIFO (open would block the reading thread for ever),
    or a folder. None of those is followed or read."""
    try:
        fd = os.open(path, _READ_NO_LINK, dir_fd=dir_fd)
    except OSError:  # missing, a link (ELOOP), not permitted
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return os.fdopen(fd, "rb")


def open_below(folder: Path, path: Path) -> BinaryIO | None:
    """`path`, a file below the job's `folder`, opened as open_file opens one, with no link followed
    on the way either (folder_below); None for anything else."""
    with folder_below(folder, path.parent) as handle:
        return open_file(path.name, dir_fd=handle) if handle is not None else None


def new_file(path: Path | str, mode: int, dir_fd: int | None = None) -> BinaryIO:
    """A new file `path` (relative to `dir_fd` when given) opened for writing: never through a link,
    never over a file (FileExistsError), with `mode` even under a umask stricter than 022."""
    out = os.fdopen(os.open(path, _NEW_FILE, mode, dir_fd=dir_fd), "wb")
    try:
        if stat.S_IMODE(os.fstat(out.fileno()).st_mode) != mode:
            os.fchmod(out.fileno(), mode)
    except BaseException:
        out.close()
        raise
    return out


def service_folder(parent: int, name: str, mode: int, where: str) -> int:
    """A handle on the folder `name` in `parent` (the `where`, for the error), made by the service with
    `mode` when missing, and the service's: PermissionError when it is not (the job made one first,
    to write into what the service keeps there). Never a link. The caller closes it."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, mode, dir_fd=parent)
    fd = open_folder(name, parent)
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise PermissionError(f"'{name}' in the {where} was not made by the service")
    return fd


def chmod_folder(parent: int, name: str, mode: int = 0o700) -> None:
    """Give folder `name` in `parent` `mode`, through a handle (so a link swapped in meanwhile is not
    followed: O_PATH with O_NOFOLLOW opens the link itself, and that fails)."""
    with closing(os.open(name, _FOLDER_PATH_NO_LINK, dir_fd=parent)) as path_only:
        os.chmod(f"/proc/self/fd/{path_only}", mode)


def names(handle: int | None, most: int) -> list[str]:
    """The first `most` names in the folder `handle` (none for None, or when unreadable): a job makes
    as many names in its folders as it likes, and a look at one reads a bounded part of it."""
    if handle is None:
        return []
    try:
        with os.scandir(handle) as entries:
            return [entry.name for entry in itertools.islice(entries, most)]
    except OSError:
        return []


def entry(name: str, folder: int) -> os.stat_result | None:
    """What stands at `name` in `folder`, as itself (a link is not followed); None when nothing does."""
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return None


def stands(path: Path) -> bool:
    """Whether anything stands at `path`, a link included (itself, not its target)."""
    return os.path.lexists(path)
