"""What the service (root in production) writes in a job's folder: the folder itself, submitit's pickle
and batch script (the backends'), an earlier attempt's files moved aside, and the link to its code
snapshot's shared copy.

The job's account owns the job folder, and a job of that account still running could swap any name in
it (`submitit` included) for a link to any folder while we write: so every write, rename and removal
goes through a handle on the folder opened without following a link (service.jobfs.handles), and
creates a new file that is no link either. The folders above it are the service's: checking the last
step is enough.
"""

from __future__ import annotations

import contextlib
import os
import stat
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from service.jobfs.handles import closing, folder_handle, new_file, service_folder
from service.jobfs.names import ATTEMPTS, CODE, DATA_DIR_MODE
from service.jobfs.reads import error_ranks
from worker.spec import JobFiles

if TYPE_CHECKING:
    from service.accounts import Account

READABLE = 0o644  # the job's account reads what the service wrote (its folder keeps others out)


# ---------------------------------------------------------------- the backends' files


def write_new_file(folder: Path, name: str, data: bytes, mode: int = READABLE) -> None:
    """A new file `name` in `folder` (never through a link, never over a file)."""
    with folder_handle(folder) as handle, new_file(name, mode, dir_fd=handle) as out:
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


# ---------------------------------------------------------------- the dispatcher's


def make_job_folder(files: JobFiles, account: Account, group: str | None) -> None:
    """The job's folder and submitit's inside it, owned by the account the job runs as.

    Mode 0700 (0750 with the operator's group): another user's job can neither read it nor plant
    files in it. The job folder first, then submitit's inside it: each metadata call is costly on a
    busy disk, and a sweep makes hundreds of these at once, so a folder this call made is not looked
    at again. The spec travels in submitit's pickle; rank 0 writes spec.json when it starts.
    """
    mode = 0o750 if group else 0o700
    for folder in (files.folder, files.submitit):
        if not _made_folder(folder, mode) and not stat.S_ISDIR(os.lstat(folder).st_mode):
            # A retry's folder was the job's to write: what stands at this name must be a real folder.
            raise NotADirectoryError(f"{folder} is not a folder (a link the job made?)")
        account.own(folder, group)


def _made_folder(folder: Path, mode: int) -> bool:
    """Make `folder`; False when something stood at its name already."""
    try:
        os.mkdir(folder, mode)
    except FileExistsError:
        return False
    except FileNotFoundError:  # the first job of a new data directory
        folder.parent.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
        os.mkdir(folder, mode)
    return True


def archive_attempt(files: JobFiles, attempt: int, world_size: int) -> None:
    """Move what attempt `attempt` left that the next one must not meet to `attempts/<attempt>/`: its
    submitit folder, whose pickle would name the old id to a recovering dispatcher, and its error
    files. Checkpoints, progress and the rendezvous files (keyed by attempt) stay.

    The job folder is the job's own, and the job is untrusted: it may have planted symlinks there. So
    every step works on directory handles opened without following links, the archive folders are
    the service's (a job can read them, not write them), and an entry already archived is never
    replaced: a second dispatch of the same attempt (after a refused sbatch) leaves the new
    attempt's own submitit folder where it is.
    """
    moved = [*(files.error(rank).name for rank in error_ranks(files, world_size)), files.submitit.name]
    with (
        folder_handle(files.folder) as folder,
        closing(service_folder(folder, ATTEMPTS, 0o755, "job folder")) as attempts,
        closing(service_folder(attempts, str(attempt), 0o755, "job folder")) as archive,
    ):
        for name in moved:
            if _exists(name, archive):
                continue
            with contextlib.suppress(FileNotFoundError):  # rename moves a link, never its target
                os.rename(name, name, src_dir_fd=folder, dst_dir_fd=archive)


def _exists(name: str, folder: int) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def link_code(folder: Path, tree: Path) -> Path:
    """`<folder>/code` as a link to `tree`, the snapshot's copy its account's jobs share
    (service.domain.code_copies): a link costs no bytes however many jobs run the snapshot. A retry
    whose folder holds a copy of its own (made before copies were shared) keeps it.

    The job folder is the job's account's, which could put anything at `code` while we write: so the
    link is made at a new name and renamed over `code`, relative to a handle on the job folder opened
    without following links (a link at `code` is replaced, never followed)."""
    with folder_handle(folder) as handle:
        try:
            existing = os.stat(CODE, dir_fd=handle, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(existing.st_mode):
                return folder / CODE
        building = f".{CODE}-{uuid.uuid4().hex}"
        os.symlink(tree, building, dir_fd=handle)
        try:
            os.rename(building, CODE, src_dir_fd=handle, dst_dir_fd=handle)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(building, dir_fd=handle)
    return folder / CODE
