"""The running service prunes by itself: its housekeeping pass removes a finished job's files (its logs
kept), then its folder, and leaves a running job alone; the job says what was removed and when, and
its logs, events and metrics stay readable as long as the rules keep them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from tests.fakes import FakeBackend
from tests.support import JOBS, authorize, submit, wait_for, wait_state

SECOND_IN_DAYS = 1 / 86400


@pytest.fixture
def pruning(settings: Settings, fake: FakeBackend) -> Iterator[TestClient]:
    quick = settings.model_copy(
        update={
            "keep_finished_days": 1 * SECOND_IN_DAYS,
            "keep_logs_days": 4 * SECOND_IN_DAYS,
            "gc_interval_s": 0.2,
        }
    )
    with TestClient(create_app(quick, backends={"local": fake})) as client:
        yield authorize(client)


def job(api: TestClient, job_id: int) -> dict[str, Any]:
    found: dict[str, Any] = api.get(f"{JOBS}/{job_id}").raise_for_status().json()
    return found


def test_the_background_pass_removes_files_then_the_folder_of_finished_jobs_only(
    pruning: TestClient, fake: FakeBackend
) -> None:
    api = pruning
    finished, running = int(submit(api)["id"]), int(submit(api)["id"])
    for job_id in (finished, running):
        folder = Path(wait_state(api, job_id, "running")["folder"])
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "ckpt-00000001.pt").write_bytes(b"c" * 10_000)
        fake.write_log(job_id, 0, "hello from rank 0\n")
    fake.finish(finished, {"ok": True})
    wait_state(api, finished, "succeeded")

    emptied = wait_for(lambda: (j := job(api, finished))["files_removed_at"] and j, 10, "the files removed")
    assert emptied["folder_removed_at"] is None
    assert api.get(f"{JOBS}/{finished}/logs").text == "hello from rank 0\n", "logs outlive the files"
    assert api.get(f"{JOBS}/{finished}/checkpoints").json() == []

    gone = wait_for(lambda: (j := job(api, finished))["folder_removed_at"] and j, 10, "the folder removed")
    assert not Path(gone["folder"]).exists() and gone["folder_bytes"] == 0
    assert gone["state"] == "succeeded" and gone["result"] == {"ok": True}
    assert [e["to_state"] for e in api.get(f"{JOBS}/{finished}/events").json()][-1] == "succeeded"
    assert api.get(f"{JOBS}/{finished}/logs").text == ""

    still = job(api, running)
    assert still["files_removed_at"] is None and still["folder_removed_at"] is None
    assert (Path(still["folder"]) / "checkpoints" / "ckpt-00000001.pt").exists()
