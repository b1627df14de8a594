"""What a backend (running as the service, root in production) writes in a job's submitit folder: the
pickle submitit's runtime loads, and for SLURM the batch script. The job's account owns the job folder,
and a job of the same account still running could swap `submitit` for a link to any folder while we
write, so every write, rename and removal goes through a handle on that folder opened without
following a link, and creates a new file that is no link either. The folders above it are the
service's: checking the last step is enough.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

_FOLDER_NO_LINK = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
READABLE = 0o644  # the job's account reads what the service wrote (its folder keeps others out)


@contextlib.contextmanager
def folder_handle(folder: Path) -> Iterator[int]:
    """A handle on `folder`, which must not be a link (OSError otherwise)."""
    fd = os.open(folder, _FOLDER_NO_LINK)
    try:
        yield fd
    finally:
        os.close(fd)


def write_new_file(folder: Path, name: str, data: bytes, mode: int = READABLE) -> None:
    """A new file `name` in `folder` (never through a link, never over a file)."""
    with (
        folder_handle(folder) as handle,
        os.fdopen(os.open(name, _NEW_FILE, mode, dir_fd=handle), "wb") as out,
    ):
        if stat.S_IMODE(os.fstat(out.fileno()).st_mode) != mode:  # a umask stricter than 022
            os.fchmod(out.fileno(), mode)
        out.write(data)


def rename_in(folder: Path, name: str, new_name: str) -> None:
    with folder_handle(folder) as handle:
        os.rename(name, new_name, src_dir_fd=handle, dst_dir_fd=handle)


def remove_from(folder: Path, name: str) -> None:
    """Best effort: a folder the job has replaced (a link now) keeps what is in it."""
    with contextlib.suppress(OSError), folder_handle(folder) as handle:
        os.unlink(name, dir_fd=handle)


def names_in(folder: Path) -> list[str]:
    """What `folder` holds; nothing when it is missing or a link (the job's doing)."""
    try:
        with folder_handle(folder) as handle:
            return os.listdir(handle)
    except OSError:
        return []
