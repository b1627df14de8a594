"""A code snapshot's unpacked copy, shared by the jobs that run it: one per (snapshot, Unix account).

A job's `code` is a link to its copy (service.jobfs.link_code), not a copy of its own: sixteen jobs
of one archive cost its files' bytes once, and those bytes count against the snapshot's owner at
upload (service.domain.code_store).

Who may read a copy decides its shape. The ranks run as the job's account (`Job.run_as`); the store
is the service's alone (0700), and one user's account must not read another's code. So the copies
live in `<data dir>/code-copies/` (0711: any account may pass through, none may list it), each as
`<digest>.<account>/tree/`: the gate `<digest>.<account>` is given to that account alone, mode 0500
(0550 to the operator's TORCHYARD_JOB_FOLDER_GROUP, as job folders are), and the tree inside it is the
service's, read-only (folders 0755, files 0444 or 0555). Another account cannot pass the gate; the
jobs of the account pass it and can change nothing below it. That account could chmod its own gate
and swap the tree for another: that changes what its own jobs run, which they could do anyway.
Two accounts running the same snapshot get a copy each (another user's job of the same archive
never reads through this user's gate); a copy per job is what this replaced.

A copy is built in a `.<random>.partial` folder of the same root (0700 while it is built) and renamed
into place whole, so a gate that exists holds a complete tree. The snapshot's collection removes its
copies with it (`remove_copies`); a finished job's `code` link then leads nowhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tarfile
import time
import uuid
from pathlib import Path

from service.accounts import Account
from service.config import Settings
from service.domain.code_archive import unpack

COPIES = "code-copies"
COPIES_MODE = 0o711  # passable by the jobs' accounts, listable by none
TREE = "tree"


def copies_root(settings: Settings) -> Path:
    return settings.data_dir.resolve() / COPIES


def copy_tree(settings: Settings, digest: str, account: Account) -> Path:
    """Where the tree of snapshot `digest` for `account`'s jobs is (or will be): what a job's `code`
    links to."""
    return copies_root(settings) / f"{digest}.{account.name}" / TREE


def is_ready(tree: Path) -> bool:
    """True once the copy is in place (it is renamed in whole, so a gate that exists is complete)."""
    return tree.parent.is_dir()


def build_copy(settings: Settings, digest: str, archive: Path, account: Account, deadline: float) -> Path:
    """The copy of snapshot `digest` for `account`, unpacked from its stored `archive` (every member
    checked again) by `deadline` (time.monotonic(); past it, code_archive.TooSlow). Made once: a copy
    already there, or one another replica finished first, is kept."""
    tree = copy_tree(settings, digest, account)
    if is_ready(tree):
        return tree
    root = copies_root(settings)
    root.mkdir(mode=COPIES_MODE, parents=True, exist_ok=True)
    partial = root / f".{uuid.uuid4().hex}.partial"
    partial.mkdir(mode=0o700)
    try:
        (partial / TREE).mkdir(mode=0o755)
        with tarfile.open(archive, mode="r:*") as tar:
            unpack(tar, partial / TREE, deadline)
        group = settings.job_folder_group
        account.own(partial, group)
        partial.chmod(0o550 if group else 0o500)
        try:  # within one folder: renaming a folder the service cannot write is allowed
            os.rename(partial, tree.parent)
        except OSError:  # ENOTEMPTY / EEXIST: another builder's copy is in place
            if not is_ready(tree):
                raise
    finally:
        _remove(partial)
    return tree


def remove_copies(settings: Settings, digests: list[str]) -> None:
    """Every account's copy of these snapshots (the caller has forgotten them, and no unfinished job
    uses them), and the partial trees of builds a stopped service left (older than a deadline's
    double: no build still running is that old)."""
    root = copies_root(settings)
    wanted = set(digests)
    left_before = time.time() - 2 * settings.code_unpack_timeout_s
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(root):
            if name.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(root / name, follow_symlinks=False).st_mtime < left_before:
                        _remove(root / name)
            elif name.split(".", 1)[0] in wanted:
                _remove(root / name)


def _remove(gate: Path) -> None:
    """A gate and its tree. The gate may be an account's (and so hold anything it put there):
    shutil.rmtree follows no link on Linux. A gate of the service's own (no accounts to switch to)
    is 0500: made writable first."""
    with contextlib.suppress(FileNotFoundError, PermissionError):
        if os.stat(gate, follow_symlinks=False).st_uid == os.geteuid():
            gate.chmod(0o700)
    shutil.rmtree(gate, ignore_errors=True)
