"""GET /jobs/{id}/checkpoints and /checkpoints/{name}: the owner (or an admin) lists and downloads rank 0's
checkpoints, streamed; anyone else gets the 404 an unknown job gets; nothing the job planted (a link, a
FIFO, a folder) is listed or read."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

from fastapi.testclient import TestClient

from tests.conftest import Login
from tests.support import JOBS, submit, wait_state
from worker.spec import JobFiles


def job_with_checkpoints(api: TestClient) -> tuple[int, JobFiles]:
    job_id = int(submit(api)["id"])
    job = wait_state(api, job_id, "running")
    files = JobFiles(Path(job["folder"]))
    files.checkpoints.mkdir()
    files.checkpoint_file(8).write_bytes(b"eight" * 1000)
    note = {"step": 8, "metrics": {"loss": 0.5}}
    files.checkpoint_note(files.checkpoint_file(8)).write_text(json.dumps(note))
    files.checkpoint_file(16).write_bytes(b"sixteen")
    return job_id, files


def test_the_owner_lists_and_downloads_checkpoints(api: TestClient) -> None:
    job_id, _ = job_with_checkpoints(api)

    listed = api.get(f"{JOBS}/{job_id}/checkpoints").raise_for_status().json()
    assert [(c["name"], c["step"], c["bytes"], c["metrics"]) for c in listed] == [
        ("ckpt-00000008.pt", 8, 5000, {"loss": 0.5}),
        ("ckpt-00000016.pt", 16, 7, {}),
    ]
    response = api.get(f"{JOBS}/{job_id}/checkpoints/ckpt-00000008.pt")
    assert response.status_code == 200
    assert response.content == b"eight" * 1000
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.headers["content-length"] == "5000"
    assert 'filename="ckpt-00000008.pt"' in response.headers["content-disposition"]


def test_others_get_404_and_an_admin_may_read(api: TestClient, login: Login) -> None:
    job_id, _ = job_with_checkpoints(api)
    for path in ("checkpoints", "checkpoints/ckpt-00000016.pt"):
        assert api.get(f"{JOBS}/{job_id}/{path}", headers=login("bob")).status_code == 404
        assert api.get(f"{JOBS}/{job_id}/{path}", headers=login("root", admin=True)).status_code == 200
    assert api.get(f"{JOBS}/{job_id + 1}/checkpoints").status_code == 404


def test_bad_and_missing_names(api: TestClient) -> None:
    job_id, _ = job_with_checkpoints(api)
    missing = api.get(f"{JOBS}/{job_id}/checkpoints/ckpt-00000009.pt")
    assert missing.status_code == 404 and missing.json()["detail"][0]["loc"] == ["checkpoint"]
    for name in ("spec.json", "ckpt-00000008.json", "..%2Fspec.json", "ckpt-1.pt.tmp"):
        response = api.get(f"{JOBS}/{job_id}/checkpoints/{name}")
        assert response.status_code in (404, 422), (name, response.status_code)
    bad = api.get(f"{JOBS}/{job_id}/checkpoints/result.json")
    assert bad.status_code == 422 and "checkpoint" in json.dumps(bad.json()["detail"])


def test_links_fifos_and_folders_the_job_planted_are_neither_listed_nor_read(
    api: TestClient, tmp_path: Path
) -> None:
    job_id, files = job_with_checkpoints(api)
    secret = tmp_path / "secret"
    secret.write_text("the service's secret")
    files.checkpoint_file(24).symlink_to(secret)
    os.mkfifo(files.checkpoint_file(32))  # opening it for reading would block a thread for ever
    files.checkpoint_file(40).mkdir()
    names = [c["name"] for c in api.get(f"{JOBS}/{job_id}/checkpoints").json()]
    assert names == ["ckpt-00000008.pt", "ckpt-00000016.pt"]
    for step in (24, 32, 40):
        assert api.get(f"{JOBS}/{job_id}/checkpoints/ckpt-{step:08d}.pt").status_code == 404

    # checkpoints/ itself swapped for a link to a folder the job may not read
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "ckpt-00000008.pt").write_text("not the job's")
    files.checkpoints.rename(files.folder / "old")
    files.checkpoints.symlink_to(elsewhere)
    assert api.get(f"{JOBS}/{job_id}/checkpoints").json() == []
    assert api.get(f"{JOBS}/{job_id}/checkpoints/ckpt-00000008.pt").status_code == 404


def test_a_large_checkpoint_is_streamed_not_read_whole(api: TestClient) -> None:
    job_id, files = job_with_checkpoints(api)
    with files.checkpoint_file(48).open("wb") as handle:  # 100 MB, sparse: cheap to make
        handle.seek(100 * 2**20 - 4)
        handle.write(b"last")

    tracemalloc.start()
    size, tail = 0, b""
    with api.stream("GET", f"{JOBS}/{job_id}/checkpoints/ckpt-00000048.pt") as response:
        assert response.status_code == 200
        for chunk in response.iter_bytes():
            size, tail = size + len(chunk), (tail + chunk)[-4:]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert size == 100 * 2**20 and tail == b"last"
    assert peak < 30 * 2**20
