"""A job's copy of its code snapshot is built where the job cannot reach and moved in whole: a link the
job's account plants in its own folder is never followed."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from service.domain.code_archive import check_archive, is_zip
from service.domain.code_store import unpack_into

DIGEST = "ab" * 32
CODE_ID = f"sha256:{DIGEST}"


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


def test_the_copy_is_read_only_and_a_retry_keeps_it(tmp_path: Path) -> None:
    store = store_with(tmp_path, {"train.py": b"print(1)\n", "pkg/net.py": b"x = 1\n"})
    job = tmp_path / "job"
    job.mkdir()
    code = unpack_into(store, CODE_ID, job)
    assert (code / "pkg" / "net.py").read_bytes() == b"x = 1\n"
    assert (code / "train.py").stat().st_mode & 0o777 == 0o444
    assert unpack_into(store, CODE_ID, job) == code  # a retry: the same copy
    assert not list((store / ".unpacking").iterdir())  # nothing left in staging


def test_a_link_the_job_planted_at_code_is_not_followed(tmp_path: Path) -> None:
    store = store_with(tmp_path, {"train.py": b"print(1)\n"})
    job, elsewhere = tmp_path / "job", tmp_path / "elsewhere"
    job.mkdir()
    elsewhere.mkdir()
    (job / "code").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(NotADirectoryError):
        unpack_into(store, CODE_ID, job)
    assert not list(elsewhere.iterdir())
    assert not list((store / ".unpacking").iterdir())


def test_a_snapshot_stored_before_the_link_rules_is_held_to_them_when_unpacked(tmp_path: Path) -> None:
    # `sub/l/m.py` lands inside the project, so tarfile's own filter lets it through; the rule that
    # no path goes through a link (what a length trick beat in tarfile, CVE-2025-4517) does not.
    store = store_with(tmp_path, {"sub/l/m.py": b"x = 1\n"}, links={"sub/l": ".."})
    job = tmp_path / "job"
    job.mkdir()
    with pytest.raises(tarfile.TarError, match=r"'sub/l/m\.py' lies inside the link 'sub/l'"):
        unpack_into(store, CODE_ID, job)
    assert not (job / "code").exists()
    assert not list((store / ".unpacking").iterdir())


def test_a_job_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    store = store_with(tmp_path, {"train.py": b"print(1)\n"})
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "job").symlink_to(real, target_is_directory=True)
    with pytest.raises(OSError):
        unpack_into(store, CODE_ID, tmp_path / "job")
    assert not list(real.iterdir())
    assert not (store / ".unpacking").exists() or not list((store / ".unpacking").iterdir())


def test_a_tar_whose_first_name_starts_with_pk_is_a_tar() -> None:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        member = tarfile.TarInfo("PKG/train.py")
        member.size = 2
        tar.addfile(member, io.BytesIO(b"x\n"))
    data = out.getvalue()
    assert data.startswith(b"PK") and not is_zip(data)
    assert [m.path for m in check_archive(data, 1 << 20)] == ["PKG/train.py"]
