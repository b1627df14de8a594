"""A data directory that cannot take a new job: POST answers 507 naming it, stores nothing, and the
service goes on serving; once the condition clears, submissions work again.

Tests run as root in CI, where permission bits stop nothing: the unwritable cases use what really
makes writes fail for root (a file where the jobs folder should be, a read-only bind mount), and the
full disk is a real one (a small tmpfs, filled up) besides the min_free_disk_mb setting.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import authorize, missing_dependency, runtime_of, wait_state

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"
BODY: dict[str, Any] = {"name": "job", "entrypoint": "worker.tasks.seed:ddp_step"}


def make_settings(data_dir: Path, ledger: Path | None, **fields: Any) -> Settings:
    return Settings(
        job_accounts="service",
        data_dir=data_dir,
        database_url=f"sqlite:///{ledger}" if ledger is not None else "",  # "": SQLite in data_dir
        reconcile_interval_s=0.05,
        local_reconcile_interval_s=0.05,
        dispatch_interval_s=0.05,
        **fields,
    )


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend("local")


def started(settings: Settings, fake: FakeBackend) -> TestClient:
    return TestClient(create_app(settings, backends={"local": fake}))


def refused(response: Any, *words: str) -> str:
    """The 507's message, checked to name every one of `words` (the data directory above all)."""
    assert response.status_code == 507, response.text
    (detail,) = response.json()["detail"]
    for word in words:
        assert word in detail["msg"], detail["msg"]
    return str(detail["msg"])


def job_count(client: TestClient) -> int:
    response = client.get(JOBS, params={"limit": 200})
    assert response.status_code == 200, response.text  # reading goes on
    return len(response.json()["items"])


def submits(client: TestClient) -> dict[str, Any]:
    response = client.post(JOBS, json=BODY)
    assert response.status_code == 201, response.text
    job: dict[str, Any] = response.json()
    wait_state(client, job["id"], "running")  # the dispatcher made its folder and handed it over
    assert (Path(job["folder"]) / "submitit").is_dir()
    return job


# ---------------------------------------------------------------- no root needed


def test_less_free_space_than_the_setting_keeps_answers_507(tmp_path: Path, fake: FakeBackend) -> None:
    data = tmp_path / "data"
    settings = make_settings(data, tmp_path / "ledger.db", min_free_disk_mb=10**9)  # a petabyte
    with started(settings, fake) as client:
        authorize(client)
        message = refused(client.post(JOBS, json=BODY), str(data), "MB free", f"{10**9} MB")
        assert "keeps for job folders" in message
        assert job_count(client) == 0 and fake.submit_calls == []
        runtime_of(client).settings.min_free_disk_mb = 1  # the operator made room
        submits(client)
        assert job_count(client) == 1


def test_a_file_where_the_jobs_folder_should_be_answers_507(tmp_path: Path, fake: FakeBackend) -> None:
    data = tmp_path / "data"
    with started(make_settings(data, tmp_path / "ledger.db"), fake) as client:
        authorize(client)
        jobs = data / "jobs"
        shutil.rmtree(jobs)  # made at start-up, holding only retention's empty trash
        jobs.write_text("not a folder")  # mkdir would fail here for root too
        refused(client.post(JOBS, json=BODY), str(data), f"{jobs} is not a directory")
        assert job_count(client) == 0 and fake.submit_calls == []
        jobs.unlink()
        submits(client)


# ---------------------------------------------------------------- mounts (root, as in CI)


def mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        missing_dependency(f"mount {' '.join(args)} failed (needs root): {done.stderr.strip()}")


def unmount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MB tmpfs of this test's own."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount("-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk))
    try:
        yield disk
    finally:
        unmount(disk)


def fill(disk: Path, name: str = "filler") -> Path:
    """Write zeros into `disk` until it refuses one more byte (ENOSPC)."""
    path = disk / name
    chunk = b"\0" * 65536
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        while True:
            try:
                os.write(descriptor, chunk)
            except OSError as error:
                assert error.errno == errno.ENOSPC, error
                if len(chunk) == 1:
                    break
                chunk = chunk[: len(chunk) // 2]
    finally:
        os.close(descriptor)
    return path


def test_a_read_only_jobs_folder_answers_507_even_for_root(tmp_path: Path, fake: FakeBackend) -> None:
    data = tmp_path / "data"
    with started(make_settings(data, tmp_path / "ledger.db"), fake) as client:
        authorize(client)
        first = submits(client)
        jobs = data / "jobs"
        mount("--bind", str(jobs), str(jobs))
        try:
            mount("-o", "remount,bind,ro", str(jobs))
            with pytest.raises(OSError, match="Read-only"):
                (jobs / "probe").mkdir()  # what the dispatcher would meet
            refused(client.post(JOBS, json=BODY), str(data), "not writable", str(jobs))
            assert job_count(client) == 1
        finally:
            unmount(jobs)
        second = submits(client)
        assert second["id"] == first["id"] + 1  # the refused POST took no id: it stored nothing


def test_a_full_disk_under_the_ledger_and_the_job_folders_answers_507(
    small_disk: Path, fake: FakeBackend
) -> None:
    data = small_disk / "data"  # the SQLite ledger lives here too: the default place
    settings = make_settings(data, None, min_free_disk_mb=0)  # only a real ENOSPC stops a job now
    reserve = small_disk / "reserve"
    with started(settings, fake) as client:
        authorize(client)
        first = submits(client)
        reserve.write_bytes(b"\0" * 8192)  # 2 pages, given back below: room for a folder, not a commit
        filler = fill(small_disk)

        # Not one free block: the folder check says so before anything is tried.
        refused(client.post(JOBS, json=BODY), str(data), "0 MB free")
        # A few pages free: the folder check passes, and the ledger's own write hits the full disk.
        reserve.unlink()
        message = refused(client.post(JOBS, json=BODY), "disk is full or read-only", str(data))
        assert "torchyard.db" in message
        assert job_count(client) == 1
        # The job ends meanwhile: the reconciler cannot record it yet, and must not die of it.
        fake.set_status(first["id"], JobState.failed, "rank 0 exited with status 1", 1)
        assert client.get(f"{JOBS}/{first['id']}").json()["state"] == "running"
        assert client.get("/healthz").status_code == 200  # the database answers: it is only full

        filler.unlink()
        wait_state(client, first["id"], "failed", timeout=70)  # its retry may back off a while
        second = submits(client)
        assert second["folder"].startswith(str(data.resolve()))
        assert job_count(client) == 2
