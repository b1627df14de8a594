"""A code snapshot's copy is built where no job can reach, moved in whole behind its account's gate,
made once and shared by links: a link the job's account plants in its own folder is never followed."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import pytest

from service.accounts import Account
from service.config import Settings
from service.domain.code_archive import TooSlow, check_archive, is_zip
from service.domain.code_copies import build_copy, copies_root, remove_copies
from service.jobfs import link_code

DIGEST = "ab" * 32
NOBODY = 65534


def store_with(tmp_path: Path, files: dict[str, bytes], links: dict[str, str] | None = None) -> Path:
    """A stored snapshot of `links` (name -> target), then `files`, written as is: not checked."""
    store = tmp_path / "store"
    store.mkdir(mode=0o700)
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for name, target in (links or {}).items():
            link = tarfile.TarInfo(name)
            link.type, link.linkname = tarfile.SYMTYPE, target
            tar.addfile(link)
        for name, content in files.items():
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(content), 0o644
            tar.addfile(member, io.BytesIO(content))
    (store / f"{DIGEST}.tar.gz").write_bytes(out.getvalue())
    return store


def build(tmp_path: Path, store: Path, deadline: float = float("inf")) -> Path:
    return build_copy(settings_at(tmp_path), DIGEST, store / f"{DIGEST}.tar.gz", Account.current(), deadline)


def settings_at(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", dev_mode=True)


def leftovers(tmp_path: Path) -> list[str]:
    """What building left in the copies' folder besides finished copies: partial trees."""
    root = copies_root(settings_at(tmp_path))
    return [name for name in os.listdir(root) if name.startswith(".")] if root.exists() else []


def test_the_copy_is_read_only_behind_its_accounts_gate_and_made_once(tmp_path: Path) -> None:
    store = store_with(tmp_path, {"train.py": b"print(1)\n", "pkg/net.py": b"x = 1\n"})
    tree = build(tmp_path, store)
    assert (tree / "pkg" / "net.py").read_bytes() == b"x = 1\n"
    assert (tree / "train.py").stat().st_mode & 0o777 == 0o444
    assert tree.parent.stat().st_mode & 0o777 == 0o500  # the account's gate: no one else passes
    assert copies_root(settings_at(tmp_path)).stat().st_mode & 0o777 == 0o711  # passable, not listable
    made = (tree / "train.py").stat().st_ino
    assert build(tmp_path, store) == tree and (tree / "train.py").stat().st_ino == made  # made once
    assert not leftovers(tmp_path)


def test_a_jobs_code_links_to_the_copy_and_a_retry_keeps_it(tmp_path: Path) -> None:
    tree = build(tmp_path, store_with(tmp_path, {"train.py": b"print(1)\n"}))
    job = tmp_path / "job"
    job.mkdir()
    code = link_code(job, tree)
    assert os.readlink(code) == str(tree) and (code / "train.py").read_bytes() == b"print(1)\n"
    assert link_code(job, tree) == code and os.readlink(code) == str(tree)
    assert sorted(os.listdir(job)) == ["code"]


def test_a_link_the_job_planted_at_code_is_replaced_not_followed(tmp_path: Path) -> None:
    tree = build(tmp_path, store_with(tmp_path, {"train.py": b"print(1)\n"}))
    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job.mkdir()
    elsewhere.mkdir()
    (job / "code").symlink_to(elsewhere, target_is_directory=True)
    link_code(job, tree)
    assert os.readlink(job / "code") == str(tree)
    assert not list(elsewhere.iterdir())


def test_a_snapshot_stored_before_the_link_rules_is_held_to_them_when_unpacked(tmp_path: Path) -> None:
    # `sub/l/m.py` lands inside the project, so tarfile's own filter lets it through; the rule that
    # no path goes through a link (what a length trick beat in tarfile, CVE-2025-4517) does not.
    store = store_with(tmp_path, {"sub/l/m.py": b"x = 1\n"}, links={"sub/l": ".."})
    with pytest.raises(tarfile.TarError, match=r"'sub/l/m\.py' lies inside the link 'sub/l'"):
        build(tmp_path, store)
    assert not os.listdir(copies_root(settings_at(tmp_path)))  # no copy, no partial tree


def test_an_unpack_past_its_deadline_stops_and_leaves_nothing(tmp_path: Path) -> None:
    store = store_with(tmp_path, {"train.py": b"print(1)\n"})
    with pytest.raises(TooSlow, match="TORCHYARD_CODE_UNPACK_TIMEOUT_S"):
        build(tmp_path, store, deadline=time.monotonic() - 1)
    assert not os.listdir(copies_root(settings_at(tmp_path)))


def test_collection_removes_every_accounts_copy_of_a_snapshot(tmp_path: Path) -> None:
    tree = build(tmp_path, store_with(tmp_path, {"train.py": b"print(1)\n"}))
    remove_copies(settings_at(tmp_path), [DIGEST])
    assert not tree.parent.exists()


def test_a_job_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    tree = build(tmp_path, store_with(tmp_path, {"train.py": b"print(1)\n"}))
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "job").symlink_to(real, target_is_directory=True)
    with pytest.raises(OSError):
        link_code(tmp_path / "job", tree)
    assert not list(real.iterdir())


def test_a_tar_whose_first_name_starts_with_pk_is_a_tar() -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        member = tarfile.TarInfo("PKG/train.py")
        member.size = 2
        tar.addfile(member, io.BytesIO(b"x\n"))
    data = out.getvalue()
    assert data.startswith(b"PK") and not is_zip(data)
    assert [m.path for m in check_archive(data, 1 << 20)] == ["PKG/train.py"]


def as_account(uid: int, code: str) -> int:
    """The exit status of `code` run by Python as `uid` (no groups)."""
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c", code],
        timeout=60, check=False,
    ).returncode  # fmt: skip


def test_only_the_jobs_account_reads_its_copy_and_it_cannot_change_it() -> None:
    """Root ignores permission bits, so each look runs as an account of its own: the copy's account
    (nobody, 65534) reads it and can write nothing in it; another account cannot even reach it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to give a copy to another account")
    base = Path(tempfile.mkdtemp(prefix="torchyard-copies-", dir="/tmp"))  # reachable by every account
    try:
        base.chmod(0o755)
        store = store_with(base, {"train.py": b"print(1)\n"})
        settings = Settings(data_dir=base / "data", dev_mode=True)
        (base / "data").mkdir(mode=0o711)
        nobody = Account("nobody", NOBODY, NOBODY, "/")
        tree = build_copy(settings, DIGEST, store / f"{DIGEST}.tar.gz", nobody, float("inf"))
        read = f"open({str(tree / 'train.py')!r}).read()"

        assert as_account(NOBODY, read) == 0
        assert as_account(NOBODY, f"open({str(tree / 'new.py')!r}, 'w')") != 0
        assert as_account(NOBODY, f"open({str(tree / 'train.py')!r}, 'a')") != 0
        assert as_account(NOBODY - 1, read) != 0  # another account: the gate stops it
        assert as_account(NOBODY - 1, f"import os; os.listdir({str(tree.parent.parent)!r})") != 0
    finally:
        shutil.rmtree(base)
