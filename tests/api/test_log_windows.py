"""Logs are served a window at a time: a huge log is never read whole, and a follower pages through it
by byte offset (X-Log-Size / X-Log-Next-Offset). Only files inside the job's folder are read."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from fastapi.testclient import TestClient

from tests.fakes import FakeBackend
from tests.support import JOBS, submit, wait_state


def running_job(api: TestClient) -> int:
    job_id = int(submit(api)["id"])
    wait_state(api, job_id, "running")
    return job_id


def test_a_follower_reads_the_whole_log_window_by_window(api: TestClient, fake: FakeBackend) -> None:
    job_id = running_job(api)
    lines = "".join(f"line {n:05d}\n" for n in range(300_000))  # 3.3 MB: several windows
    fake.write_log(job_id, 0, lines)

    read, offset, windows = [], 0, 0
    while True:
        response = api.get(f"{JOBS}/{job_id}/logs", params={"offset": offset})
        assert response.status_code == 200
        size, next_offset = int(response.headers["X-Log-Size"]), int(response.headers["X-Log-Next-Offset"])
        assert len(response.content) <= 1_000_000 and response.text.endswith("\n")
        read.append(response.text)
        windows += 1
        if next_offset == size:
            break
        offset = next_offset

    assert "".join(read) == lines
    assert windows == 4


def test_reading_the_end_of_a_huge_log_holds_one_window_in_memory(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = running_job(api)
    path = fake.write_log(job_id, 0, "")
    with path.open("wb") as handle:  # 200 MB, sparse: cheap to make, costly to read whole
        handle.seek(200 * 2**20)
        handle.write(b"\nthe last line\n")

    tracemalloc.start()
    response = api.get(f"{JOBS}/{job_id}/logs", params={"tail": 1})
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    assert response.text == "the last line\n"
    assert int(response.headers["X-Log-Size"]) == 200 * 2**20 + 15
    assert peak < 20 * 2**20  # the service's 1 MB window, a few copies: never the 200 MB file


def test_an_offset_past_the_end_gives_nothing_and_tail_with_offset_is_refused(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = running_job(api)
    fake.write_log(job_id, 0, "short\n")

    past = api.get(f"{JOBS}/{job_id}/logs", params={"offset": 10_000})
    both = api.get(f"{JOBS}/{job_id}/logs", params={"offset": 0, "tail": 3})
    negative = api.get(f"{JOBS}/{job_id}/logs", params={"offset": -1})

    assert past.status_code == 200 and past.text == "" and past.headers["X-Log-Next-Offset"] == "6"
    assert both.status_code == 422 and both.json()["detail"][0]["loc"] == ["offset"]
    assert negative.status_code == 422


def test_a_log_path_leading_out_of_the_job_folder_is_refused(
    api: TestClient, fake: FakeBackend, tmp_path: Path
) -> None:
    job_id = running_job(api)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours\n")
    log = fake.write_log(job_id, 0, "")
    log.unlink()
    log.symlink_to(secret)  # a rank's log replaced by a link out of the folder

    response = api.get(f"{JOBS}/{job_id}/logs")

    assert response.status_code == 422
    assert "a link, which may lead out of it" in response.json()["detail"][0]["msg"]
    assert "not yours" not in response.text
