"""GET /api/v1/jobs/{id}/stacks against a scripted backend whose "ranks" append faulthandler's text to
their stacks files when signalled: captured now while the job runs, grouped with the odd rank first,
kept per attempt and shown once it ended; its owner and admins only; bounded whatever a rank wrote;
one capture at a time per job; no lock held while the ranks are waited for. The same with real
ranks: tests/integration/test_stacks_local.py."""

from __future__ import annotations

import json
import pickle
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from service.backends.base import StackRequest
from tests.api.test_cancel import row_is_free_and_flagged
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import JOBS, runtime_of, submit, wait_state

STUCK = """\
Current thread 0x00007f3b938d2040 (most recent call first):
  File "/jobs/code/hang.py", line 12 in stuck
  File "/jobs/code/hang.py", line 30 in main
  File "<frozen runpy>", line 88 in _run_code
"""
WAITING = """\
Thread 0x00007f3b11111700 (most recent call first):
  File "/usr/lib/python3/threading.py", line 331 in wait
  File "/jobs/code/hang.py", line 8 in heartbeat

Current thread 0x00007f3b938d2040 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/site-packages/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/jobs/code/hang.py", line 25 in main
  File "<frozen runpy>", line 88 in _run_code
"""


def stacks_path(fake: FakeBackend, job_id: int, rank: int) -> Path:
    path: Path = fake.specs[job_id].files.stacks(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def ranks_answer(fake: FakeBackend, job_id: int, texts: dict[int, str | bytes]) -> None:
    """On the signal, each rank appends its text to its stacks file (as faulthandler does)."""

    def answer(job: StackRequest) -> bool:
        assert job.external_id == fake.external_id(job_id)
        for rank, text in texts.items():
            with stacks_path(fake, job_id, rank).open("ab") as handle:
                handle.write(text.encode() if isinstance(text, str) else text)
        return True

    fake.on_stacks = answer


def hung_job(api: TestClient, fake: FakeBackend) -> int:
    job_id = int(submit(api, resources={"tasks_per_node": 3})["id"])
    wait_state(api, job_id, "running")
    for rank in range(3):  # what each rank's earlier captures left there: only new bytes count
        stacks_path(fake, job_id, rank).write_text(
            'Current thread 0x1 (most recent call first):\n  File "old.py", line 1 in old\n'
        )
    ranks_answer(fake, job_id, {0: WAITING, 1: STUCK, 2: WAITING})
    return job_id


def detail(response: Any) -> str:
    return str(response.json()["detail"][0]["msg"])


def stacks(api: TestClient, job_id: int, **params: Any) -> dict[str, Any]:
    response = api.get(f"{JOBS}/{job_id}/stacks", params=params)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_a_running_jobs_stacks_name_the_odd_rank_and_group_the_others(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = hung_job(api, fake)

    capture = stacks(api, job_id)

    assert capture["fresh"] is True and capture["trigger"] == "request" and capture["attempt"] == 1
    assert [group["ranks"] for group in capture["groups"]] == [[1], [0, 2]]  # the odd rank first
    assert capture["groups"][1]["label"] == "0, 2"
    stuck = capture["groups"][0]["threads"][0]["frames"][0]
    assert stuck == {"file": "/jobs/code/hang.py", "line": 12, "function": "stuck"}
    assert "rank 1" in capture["summary"] and "hang.py:12 stuck" in capture["summary"]
    assert "all_reduce" in capture["summary"]
    assert [len(rank["threads"]) for rank in capture["ranks"]] == [2, 1, 2]  # every thread, new bytes only
    assert all(rank["note"] is None for rank in capture["ranks"])
    assert len(fake.stack_calls) == 1  # one signal for the job, not one per rank
    assert capture["took_s"] < 2.0

    kept = stacks(api, job_id, capture="false")  # the kept capture, nothing signalled
    assert kept["fresh"] is False and kept["groups"] == capture["groups"]
    assert len(fake.stack_calls) == 1


def test_only_the_owner_and_admins_see_a_jobs_stacks(
    api: TestClient, fake: FakeBackend, login: Login
) -> None:
    job_id = hung_job(api, fake)

    other = api.get(f"{JOBS}/{job_id}/stacks", headers=login("bob"))
    missing = api.get(f"{JOBS}/999999/stacks")
    admin = api.get(f"{JOBS}/{job_id}/stacks", headers=login("root", admin=True))

    assert other.status_code == 404 and missing.status_code == 404
    assert detail(other) == detail(missing).replace("999999", str(job_id))
    assert admin.status_code == 200 and admin.json()["groups"][0]["ranks"] == [1]
    assert len(fake.stack_calls) == 1  # bob's request signalled nothing
    entries = api.get("/api/v1/audit", headers=login("root", admin=True)).json()
    read = [entry for entry in entries if entry["action"] == "job.stacks"]
    said = [(one["actor"], one["target"], one["detail"]) for one in read]
    assert said == [("root", f"job {job_id}", "owner=alice")]  # an admin's read is on the record


def test_a_finished_job_shows_its_last_capture_and_captures_nothing(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = hung_job(api, fake)
    first = stacks(api, job_id)
    second = stacks(api, job_id)  # the attempt keeps its last capture only
    fake.finish(job_id, "done")
    wait_state(api, job_id, "succeeded")

    shown = stacks(api, job_id)
    again = api.get(f"{JOBS}/{job_id}/stacks", params={"capture": "true"})

    assert shown["fresh"] is False and shown["captured_at"] == second["captured_at"] != first["captured_at"]
    assert shown["groups"] == second["groups"]
    assert again.status_code == 409 and "running" in detail(again)
    assert len(fake.stack_calls) == 2


def test_a_job_that_is_not_running_and_has_no_capture_is_409(api: TestClient, fake: FakeBackend) -> None:
    fake.submit_error = "scheduler down"  # it stays queued
    queued = int(submit(api)["id"])

    response = api.get(f"{JOBS}/{queued}/stacks")

    assert response.status_code == 409
    assert "no stacks captured" in detail(response) and "queued" in detail(response)
    assert fake.stack_calls == []


def test_a_huge_or_binary_stacks_file_costs_a_bounded_read_and_a_note(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = hung_job(api, fake)

    def hostile(job: StackRequest) -> bool:
        with stacks_path(fake, job_id, 0).open("r+b") as handle:  # 1 GiB more, sparse
            handle.truncate(2**30)
        stacks_path(fake, job_id, 1).open("ab").write(STUCK.encode())
        garbage = bytes(range(256)) * 64 + b"\x00\xff\xfe" * 1000 + b"\xed\xa0\x80"
        stacks_path(fake, job_id, 2).open("ab").write(garbage)
        return True

    fake.on_stacks = hostile
    tracemalloc.start()
    capture = stacks(api, job_id)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    notes = {rank["rank"]: rank["note"] for rank in capture["ranks"]}
    assert "bytes" in notes[0] and "64 KiB" in notes[0]
    assert "no stack" in notes[2]
    assert notes[1] is None and capture["groups"][0]["threads"][0]["frames"][0]["function"] == "stuck"
    assert peak < 16 * 2**20  # a bounded read of each rank, never the GiB
    assert "\x00" not in str(capture)


def test_a_rank_that_writes_nothing_is_noted_and_the_wait_is_bounded(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = hung_job(api, fake)
    ranks_answer(fake, job_id, {1: STUCK})  # ranks 0 and 2 never answer

    started = time.monotonic()
    capture = stacks(api, job_id)
    took = time.monotonic() - started

    assert 2.9 < took < 6
    notes = {rank["rank"]: rank["note"] for rank in capture["ranks"]}
    assert notes[1] is None and "no stacks" in notes[0] and "no stacks" in notes[2]
    assert capture["groups"][0]["ranks"] == [1] or 1 in capture["groups"][-1]["ranks"]


def test_one_capture_at_a_time_per_job_shared_by_callers_that_come_meanwhile(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = hung_job(api, fake)
    runtime = runtime_of(api)
    answer = fake.on_stacks
    assert answer is not None

    def slow(job: StackRequest) -> bool:
        time.sleep(0.5)  # the others arrive while this one is under way
        return answer(job)

    fake.on_stacks = slow
    results: list[Any] = []

    def run() -> None:
        results.append(runtime.captures.submit(job_id, "alice", "stall").result(timeout=20))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)

    assert len(fake.stack_calls) == 1
    assert len(results) == 4 and all(result == results[0] for result in results)
    assert results[0].trigger == "stall" and results[0].groups[0].ranks == [1]


def test_no_row_lock_or_write_is_held_while_the_ranks_are_waited_for(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = hung_job(api, fake)
    engine = runtime_of(api).engine
    answer = fake.on_stacks
    assert answer is not None
    seen: list[bool] = []

    def look(job: StackRequest) -> bool:
        seen.append(row_is_free_and_flagged(engine, job_id))  # raises if the row (or SQLite) is locked
        return answer(job)

    fake.on_stacks = look
    stacks(api, job_id)

    assert seen == [False]


def test_a_ranks_host_comes_from_its_activity_file_until_its_placement_is_read(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = hung_job(api, fake)
    files = fake.specs[job_id].files
    for rank in range(3):
        files.activity(rank).parent.mkdir(parents=True, exist_ok=True)
        record = {"attempt": 1, "rank": rank, "host": f"n{rank % 2 + 1}", "pid": 100 + rank,
                  "time": time.time(), "changed_at": time.time(), "where": None}  # fmt: skip
        files.activity(rank).write_text(json.dumps(record))

    capture = stacks(api, job_id)

    assert [rank["host"] for rank in capture["ranks"]] == ["n1", "n2", "n1"]
    assert capture["summary"].startswith("rank 1 on n2 ")
    assert "ranks 0, 2 on n1 wait in all_reduce" in capture["summary"]


def test_a_flight_recorder_dump_with_a_5000_digit_int_notes_its_rank_and_answers_200(
    api: TestClient, fake: FakeBackend
) -> None:
    """Issue 43, finding 9: Python's int-to-text limit made the route 500."""
    job_id = hung_job(api, fake)
    files = fake.specs[job_id].files
    last = {"collective_seq_id": 7, "profiling_name": "nccl:all_reduce", "state": "started"}
    good = {"version": "2.10", "entries": [{**last, "process_group": ("0", "default_pg")}]}
    hostile = {"version": "2.10", "entries": [{**last, "pg_id": 10**5000 - 1}]}  # 5,000 digits
    for rank, dump in ((0, good), (1, hostile), (2, good)):
        files.flight_recorder(rank).write_bytes(pickle.dumps(dump, protocol=2))

    capture = stacks(api, job_id)

    notes = {rank["rank"]: rank["note"] for rank in capture["ranks"]}
    assert notes[0] is None and notes[2] is None
    assert "flight recorder dump could not be read" in notes[1]
    assert capture["groups"][0]["ranks"] == [1]  # its stacks read as ever
