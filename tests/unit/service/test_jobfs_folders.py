"""Removing job folders as a service that is not root (jobs then run as the service's own account): a job
may have taken the permissions off its own folders, and they still go; a link still goes as itself.

Root ignores permission bits, so the removal runs in a child process as `nobody`, on folders it owns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.jobfs import folders
from tests.support import ROOT

NOBODY = 65534


@pytest.fixture
def jobs() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to hand the folders to another account")
    base = Path(tempfile.mkdtemp(prefix="torchyard-folders-", dir="/tmp"))  # reachable by nobody
    base.chmod(0o755)
    jobs = base / "jobs"
    jobs.mkdir()
    yield jobs
    shutil.rmtree(base)


def as_nobody(code: str) -> None:
    subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c",
         f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
         f"from service.jobfs import folders; {code}"],
        check=True, timeout=60,
    )  # fmt: skip


def chown_tree(top: Path) -> None:
    for path in [top, *top.rglob("*")]:
        os.chown(path, NOBODY, NOBODY, follow_symlinks=False)


def test_a_service_that_is_not_root_removes_folders_a_job_locked(jobs: Path) -> None:
    secret = jobs.parent / "secret"
    secret.write_text("root's")
    for job_id in ("1", "2"):
        folder = jobs / job_id
        (folder / "locked" / "inner").mkdir(parents=True)
        (folder / "locked" / "inner" / "data").write_text("x")
        (folder / "readonly").mkdir()
        (folder / "readonly" / "data").write_text("y")
        (folder / "submitit").mkdir()
        (folder / "submitit" / "5_0_log.out").write_text("log")
        (folder / "submitit" / "5_submitted.pkl").write_text("pickle")
        (folder / "link").symlink_to(secret)
    chown_tree(jobs)
    jobs.chmod(0o711)
    (jobs / "1").chmod(0o500)
    for job_id in ("1", "2"):
        (jobs / job_id / "locked").chmod(0)
        (jobs / job_id / "readonly").chmod(0o500)
        (jobs / job_id / "submitit").chmod(0o500)

    as_nobody(
        f"folders.move_folder_to_trash(Path({str(jobs / '1')!r})); "
        f"folders.move_files_to_trash(Path({str(jobs / '2')!r})); "
        f"assert folders.empty_trash(Path({str(jobs)!r})) > 0"
    )

    assert not (jobs / "1").exists()
    assert jobs.stat().st_mode & 0o777 == 0o711, "the jobs folder keeps its mode"
    assert sorted(p.name for p in (jobs / "2").rglob("*")) == ["5_0_log.out", "submitit"]
    assert os.listdir(jobs / folders.TRASH) == []
    assert secret.read_text() == "root's"
