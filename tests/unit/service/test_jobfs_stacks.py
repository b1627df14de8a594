"""service.jobfs.stacks: the ranks' stacks files read after their noted sizes, activity files and flight
recorder dumps, bounded, from regular files only, never through a link."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from service.jobfs import (
    read_activity,
    read_flight_records,
    read_stack_texts,
    read_stacks_after,
    stack_sizes,
)
from service.jobfs.stacks import MAX_DUMP_BYTES, STACKS_LIMIT_BYTES
from worker.spec import JobFiles

DUMP = 'Thread 0x0000000000000001 (most recent call first):\n  File "t.py", line 1 in f\n'


def job(tmp_path: Path) -> JobFiles:
    files = JobFiles(tmp_path / "job")
    files.stacks(0).parent.mkdir(parents=True)
    files.activity(0).parent.mkdir(parents=True)
    return files


def test_only_what_was_appended_after_the_noted_size_is_read(tmp_path: Path) -> None:
    files = job(tmp_path)
    files.stacks(0).write_text("an earlier capture\n")
    sizes = stack_sizes(files.folder, 3)
    assert sizes == {0: len("an earlier capture\n"), 1: 0, 2: 0}  # ranks 1 and 2 have not started
    with open(files.stacks(0), "a") as out:
        out.write(DUMP)
    files.stacks(1).write_text(DUMP)
    assert read_stacks_after(files.folder, sizes) == {0: DUMP, 1: DUMP}  # rank 2 wrote nothing
    assert stack_sizes(tmp_path / "no-such-job", 2) == {0: 0, 1: 0}


def test_a_huge_binary_file_costs_a_bounded_read(tmp_path: Path) -> None:
    files = job(tmp_path)
    with open(files.stacks(0), "wb") as out:
        out.truncate(1024**3)  # a sparse GiB
    with open(files.stacks(0), "r+b") as out:
        out.seek(1024**3 - 4000)
        out.write(b"\x00\xff\xfe" * 1000 + "\ud800".encode("utf-8", "surrogatepass"))
    (read,) = read_stack_texts(files.folder, {0: 0}).values()
    assert read.cut and not read.restarted and len(read.text) <= STACKS_LIMIT_BYTES
    assert "\x00" not in read.text and "\ud800" not in read.text and "\ufffd" in read.text


def test_of_a_long_dump_the_end_is_read_where_the_main_thread_is(tmp_path: Path) -> None:
    files = job(tmp_path)
    helper = 'Thread 0x0000000000000002 (most recent call first):\n' + '  File "lib.py", line 1 in g\n' * 99
    main = 'Current thread 0x0000000000000001 (most recent call first):\n  File "train.py", line 41 in step\n'
    files.stacks(0).write_text("before\n" + (helper + "\n") * 40 + main)  # > 100 KiB
    read = read_stack_texts(files.folder, {0: len("before\n")})[0]
    assert read.cut and read.text.endswith(main) and len(read.text) <= STACKS_LIMIT_BYTES
    assert read.text.startswith(("  File", "Thread"))  # from a whole line


def test_a_file_shorter_than_noted_is_read_from_its_start(tmp_path: Path) -> None:
    files = job(tmp_path)
    files.stacks(0).write_text(DUMP)
    read = read_stack_texts(files.folder, {0: 10_000})[0]
    assert read.restarted and read.text == DUMP and not read.cut


def test_links_and_fifos_are_not_followed(tmp_path: Path) -> None:
    files = job(tmp_path)
    secret = tmp_path / "secret"
    secret.write_text(DUMP)
    files.stacks(0).symlink_to(secret)
    os.mkfifo(files.stacks(1))  # opening it for reading would block
    files.stacks(2).write_text(DUMP)
    assert stack_sizes(files.folder, 3) == {2: len(DUMP)}  # a link or a FIFO has no size to note
    reader = threading.Thread(target=lambda: read_stacks_after(files.folder, {0: 0, 1: 0, 2: 0}))
    started = time.monotonic()
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive() and time.monotonic() - started < 5
    assert read_stacks_after(files.folder, {0: 0, 1: 0, 2: 0}) == {2: DUMP}


def test_a_stacks_folder_swapped_for_a_link_is_not_read(tmp_path: Path) -> None:
    files = JobFiles(tmp_path / "job")
    elsewhere = tmp_path / "other-job" / "stacks"
    elsewhere.mkdir(parents=True)
    (elsewhere / "rank0.txt").write_text(DUMP)
    files.folder.mkdir()
    files.stacks(0).parent.symlink_to(elsewhere)
    assert read_stacks_after(files.folder, {0: 0}) == {}
    assert stack_sizes(files.folder, 1) == {0: 0}
    (elsewhere / "rank0.json").write_text(json.dumps(activity(0)))
    files.activity(0).parent.symlink_to(elsewhere)
    assert read_activity(files.folder, 1) == []


def activity(rank: int, **fields: object) -> dict[str, object]:
    return {"attempt": 2, "rank": rank, "host": "n1", "pid": 100 + rank, "time": 1000.0, "changed_at": 990.0,
            "where": "/job/train.py:41 next_batch", **fields}  # fmt: skip


def test_activity_records_are_read_per_rank_and_bounded(tmp_path: Path) -> None:
    files = job(tmp_path)
    files.activity(0).write_text(json.dumps(activity(0)))
    files.activity(1).write_text(json.dumps(activity(2)))  # names another rank
    files.activity(2).write_text('{"attempt": 2, "rank": 2, "ho')  # torn
    files.activity(3).write_text(json.dumps(activity(3, where="x" * 10_000)))  # too large to read
    files.activity(4).write_text(json.dumps(activity(4, attempt=1)))  # an earlier attempt's
    files.activity(5).write_text(json.dumps(activity(5, where="a\x00b", changed_at=2000.0, pid="7")))
    files.activity(6).write_text(json.dumps(activity(6, where="a\x00b", changed_at=2000.0)))
    found = read_activity(files.folder, 8, attempt=2)
    assert [record.rank for record in found] == [0, 6]
    assert found[0].where == "/job/train.py:41 next_batch" and found[0].changed_at == 990.0
    assert found[1].where == "ab" and found[1].changed_at == 1000.0  # never after its own time
    assert [record.rank for record in read_activity(files.folder, 8)] == [0, 4, 6]


def test_flight_recorder_dumps_are_read_whole_or_not_at_all(tmp_path: Path) -> None:
    files = job(tmp_path)
    files.flight_recorder(0).write_bytes(b"\x80\x02}q\x00.")
    files.flight_recorder(1).write_bytes(b"x" * (MAX_DUMP_BYTES + 1))
    files.flight_recorder(2).symlink_to(files.flight_recorder(0))
    files.flight_recorder(3).write_bytes(b"")
    assert read_flight_records(files.folder, 5) == {0: b"\x80\x02}q\x00."}
    os.utime(files.flight_recorder(0), (1000.0, 1000.0))
    assert read_flight_records(files.folder, 5, since=1000.0) == {0: b"\x80\x02}q\x00."}
    assert read_flight_records(files.folder, 5, since=1001.0) == {}  # an earlier capture's, or timeout's
