"""GET /jobs/{id}/checkpoints and /checkpoints/{name}: the owner (or an admin) lists and downloads rank 0's
checkpoints, streamed; anyone else gets the 404 an unknown job gets; nothing the job planted (a link, a
FIFO, a folder) is listed or read."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest
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
    files.checkpoint_note(files.checkpoint_file(16)).write_text(json.dumps({"step": 16}))  # no metrics
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


def test_a_checkpoint_is_listed_only_once_its_note_says_it_is_whole(api: TestClient) -> None:
    job_id, files = job_with_checkpoints(api)
    files.checkpoint_file(24).write_bytes(b"half")  # renamed, its note not yet written: rank 0 died here
    (files.checkpoints / ".ckpt-00000032.pt.tmp-7").write_bytes(b"half")  # before the rename
    (files.checkpoints / "ckpt-00000040.json").write_text("{}")  # a note whose checkpoint went
    listed = api.get(f"{JOBS}/{job_id}/checkpoints").raise_for_status().json()
    assert [c["name"] for c in listed] == ["ckpt-00000008.pt", "ckpt-00000016.pt"]
    assert files.latest_checkpoint() == files.checkpoint_file(16)  # the worker's listing: the same rule
    newest = api.get(f"{JOBS}/{job_id}/checkpoints", params={"order": "newest", "limit": 1}).json()
    assert [c["name"] for c in newest] == ["ckpt-00000016.pt"]


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
    for step in (24, 32, 40):  # each with its note: listed, were it a regular file
        files.checkpoint_note(files.checkpoint_file(step)).write_text("{}")
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


def many_checkpoints(files: JobFiles, steps: range) -> None:
    """One empty file hard-linked under every name, with a note each: what a job can make cheaply."""
    files.checkpoints.mkdir(exist_ok=True)
    empty = files.folder / "empty"
    empty.write_bytes(b"")
    note = files.folder / "note.json"
    note.write_text(json.dumps({"metrics": {"loss": 1.0}}))
    for step in steps:
        os.link(empty, files.checkpoint_file(step))
        os.link(note, files.checkpoint_note(files.checkpoint_file(step)))


def test_the_list_is_paged_oldest_first_with_a_cursor(api: TestClient) -> None:
    job_id, files = job_with_checkpoints(api)  # steps 8 and 16
    many_checkpoints(files, range(100, 350))  # 252 checkpoints in all

    first = api.get(f"{JOBS}/{job_id}/checkpoints")
    assert first.status_code == 200
    steps = [c["step"] for c in first.json()]
    assert steps == [8, 16, *range(100, 198)]  # 100 a page by default, oldest first as before
    assert first.headers["x-next-after"] == "ckpt-00000197.pt"
    assert "x-listing-cut" not in first.headers

    second = api.get(f"{JOBS}/{job_id}/checkpoints", params={"after": "ckpt-00000197.pt", "limit": 200})
    assert [c["step"] for c in second.json()] == list(range(198, 350))
    assert "x-next-after" not in second.headers  # the last page

    newest = api.get(f"{JOBS}/{job_id}/checkpoints", params={"order": "newest", "limit": 3})
    assert [c["step"] for c in newest.json()] == [349, 348, 347]
    older = api.get(
        f"{JOBS}/{job_id}/checkpoints",
        params={"order": "newest", "limit": 3, "after": newest.headers["x-next-after"]},
    )
    assert [c["step"] for c in older.json()] == [346, 345, 344]
    assert older.json()[0]["metrics"] == {"loss": 1.0}

    for bad in ({"limit": 0}, {"limit": 1001}, {"after": "spec.json"}, {"order": "biggest"}):
        assert api.get(f"{JOBS}/{job_id}/checkpoints", params=bad).status_code == 422, bad


def test_only_the_page_is_stat_ed_and_its_notes_read(
    api: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.jobfs import checkpoints

    job_id, files = job_with_checkpoints(api)
    many_checkpoints(files, range(100, 2100))
    opened: list[str] = []
    real_open = checkpoints.open_file

    def counted(path: Path | str, dir_fd: int | None = None) -> object:
        opened.append(str(path))
        return real_open(path, dir_fd=dir_fd)

    monkeypatch.setattr(checkpoints, "open_file", counted)
    listed = api.get(f"{JOBS}/{job_id}/checkpoints", params={"limit": 5, "order": "newest"}).json()
    assert [c["step"] for c in listed] == [2099, 2098, 2097, 2096, 2095]
    assert len(opened) == 5  # one note a checkpoint on the page, not one per name in the folder


def test_a_folder_of_too_many_names_is_listed_in_part_and_says_so(
    api: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service.jobfs import checkpoints

    job_id, files = job_with_checkpoints(api)
    many_checkpoints(files, range(100, 400))  # 604 names with the notes
    monkeypatch.setattr(checkpoints, "MAX_SCANNED_NAMES", 100)
    response = api.get(f"{JOBS}/{job_id}/checkpoints", params={"limit": 1000})
    assert response.status_code == 200
    assert 0 < len(response.json()) <= 100
    assert response.headers["x-listing-cut"] == "100"
