"""Atomic result writing, buffered progress lines, and reading them back through the spec's parser."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

from worker import files as files_module
from worker.files import (
    ProgressWriter,
    atomic_write_text,
    to_jsonable,
    write_error,
    write_placement,
    write_result,
)
from worker.spec import (
    MAX_METRIC_NAME_CHARS,
    MAX_METRIC_NAMES,
    MAX_METRICS_PER_LINE,
    CheckpointRecord,
    JobFiles,
    ProgressRecord,
    RankPlacement,
    node_hardlinks_protected,
    parse_checkpoint_note,
    parse_error_text,
    parse_placement,
    parse_progress_line,
)


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "result.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    assert sorted(path.name for path in target.parent.iterdir()) == ["result.json"]


def test_atomic_write_never_shows_a_partial_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "result.json"
    atomic_write_text(target, "complete")

    def crash(src: object, dst: object) -> None:
        raise OSError("disk gone mid-way")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        atomic_write_text(target, "x" * 1_000_000)
    assert target.read_text() == "complete"  # readers still see the old, whole file


def test_error_file_starts_with_its_attempt(tmp_path: Path) -> None:
    path = JobFiles(tmp_path).error(1)
    assert path.name == "error-rank1.txt"
    traceback = "Traceback (most recent call last):\nRuntimeError: boom\n"
    write_error(path, 3, traceback)
    assert path.read_text().splitlines()[0] == "attempt: 3"
    assert parse_error_text(path.read_text()) == (3, traceback)
    # A file from before the attempt line (or someone else's) is all traceback, of an unknown attempt.
    assert parse_error_text("Traceback\nattempt: 2\n") == (None, "Traceback\nattempt: 2\n")
    assert parse_error_text("attempt: x\nboom") == (None, "attempt: x\nboom")
    assert parse_error_text("attempt: 5") == (5, "")


def test_result_format(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    write_result(path, 3, {"ok": True, "loss": 0.5, "where": tmp_path})
    value = {"ok": True, "loss": 0.5, "where": str(tmp_path)}
    assert json.loads(path.read_text()) == {"attempt": 3, "value": value}


def test_to_jsonable_handles_what_entrypoints_return() -> None:
    class Scalar:  # duck-typed like a 0-d tensor / numpy scalar
        ndim = 0

        def item(self) -> float:
            return 1.5

    class Vector:
        ndim = 1

        def tolist(self) -> list[int]:
            return [1, 2]

    assert to_jsonable({"a": Scalar(), "b": (Vector(), None), 3: float("nan")}) == {
        "a": 1.5,
        "b": [[1, 2], None],
        "3": "nan",
    }
    assert to_jsonable(object()).startswith("<object")


def test_progress_lines_are_buffered_until_the_interval(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    writer = ProgressWriter(path, interval_s=60)  # the thread will not flush during this test
    started = time.perf_counter()
    for step in range(2000):
        writer.append({"step": step, "total": 2000, "metrics": {"loss": 1.0}, "time": 0.0, "attempt": 1})
    per_call = (time.perf_counter() - started) / 2000
    assert not path.exists(), "report() must not touch the disk"
    assert per_call < 1e-3
    writer.close()
    lines = path.read_text().splitlines()
    assert len(lines) == 2000 and json.loads(lines[-1])["step"] == 1999


def test_progress_background_flush_happens_within_the_interval(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    writer = ProgressWriter(path, interval_s=0.05)
    writer.append({"step": 1})
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert path.read_text() == '{"step":1}\n'
    writer.append({"step": 2})
    writer.close()
    writer.close()  # idempotent
    assert path.read_text().splitlines() == ['{"step":1}', '{"step":2}']


def test_parse_progress_line_knows_both_records_and_skips_torn_lines() -> None:
    line = '{"step":5,"total":10,"metrics":{"loss":0.1,"acc":null},"time":1.0,"attempt":2}'
    progress = parse_progress_line(line)
    assert isinstance(progress, ProgressRecord) and progress.step == 5 and progress.metrics["acc"] is None
    checkpoint = parse_progress_line('{"checkpoint":"/x/ckpt-00000008.pt","step":8,"time":1.0,"attempt":2}')
    assert isinstance(checkpoint, CheckpointRecord) and checkpoint.checkpoint.endswith("08.pt")
    assert parse_progress_line('{"step":5,"tot') is None
    assert parse_progress_line("") is None
    assert parse_progress_line("[1]") is None


@pytest.mark.parametrize(
    "line",
    [
        '{"step":true,"metrics":{"loss":1}}',  # a bool is not a step
        '{"step":2147483648,"metrics":{"loss":1}}',  # beyond a 32-bit INTEGER column
        '{"step":-1}',
        '{"step":"7"}',
        '{"metrics":{"loss":1}}',
        '{"checkpoint":17}',
        '{"checkpoint":"/bad\\u0000path"}',
        "not json",
    ],
)
def test_lines_the_ledger_cannot_use_are_refused_whole(line: str) -> None:
    assert parse_progress_line(line) is None


def test_what_a_record_holds_can_be_stored_as_it_is() -> None:
    line = (
        '{"step":3,"total":"ten","time":1e400,"attempt":true,'
        '"metrics":{"loss":NaN,"acc":Infinity,"ok":0.25,"int":2,"flag":true,"word":"low","huge":'
        + "1" * 400
        + ',"nul\\u0000name":1.0,"nested":{"a":1}}}'
    )
    record = parse_progress_line(line)
    assert isinstance(record, ProgressRecord)
    assert record.step == 3 and record.total is None and record.time is None and record.attempt is None
    assert record.metrics == {
        "loss": None, "acc": None, "ok": 0.25, "int": 2.0, "flag": None, "word": None, "huge": None,
        "nested": None,
    }  # fmt: skip
    bare = parse_progress_line('{"checkpoint":"/x/ckpt-00000001.pt"}')
    assert bare == CheckpointRecord(checkpoint="/x/ckpt-00000001.pt")


def test_a_line_is_shown_as_written_with_only_what_no_reader_can_hold_cleaned() -> None:
    line = (
        '{"step":3,"total":"ten","time":1700000000,"attempt":"first","extra":1,'
        '"metrics":{"loss":NaN,"int":2,"word":"low\\ud800","nul\\u0000name":1.0,"deep":[Infinity,{"a":-Infinity}]}}'
    )
    record = parse_progress_line(line)
    assert isinstance(record, ProgressRecord)
    # NaN and infinities become None, a lone surrogate U+FFFD, and NUL is dropped.
    assert record.shown == {
        "step": 3, "total": "ten", "time": 1700000000, "attempt": "first",
        "metrics": {"loss": None, "int": 2, "word": "low\ufffd", "nulname": 1.0, "deep": [None, {"a": None}]},
    }  # fmt: skip
    assert type(record.shown["metrics"]["int"]) is int  # shown as written: 2, not 2.0
    assert "shown" not in record.model_dump()  # a record dumps as the line's format, nothing more


def test_a_line_without_time_attempt_or_metrics_is_kept() -> None:
    record = parse_progress_line(b'{"step":1}')  # bytes, as the service reads
    shown = {"step": 1, "total": None, "metrics": None, "time": None, "attempt": None}
    assert record == ProgressRecord(step=1, shown=shown)
    assert isinstance(record, ProgressRecord) and record.time is None and record.attempt is None
    assert record.metrics == {}
    built = ProgressRecord(step=2, metrics={"loss": 0.5})  # built by hand, a record shows its fields
    assert built.shown == {"step": 2, "total": None, "metrics": {"loss": 0.5}, "time": None, "attempt": None}


@pytest.mark.parametrize("step", [True, False, 2**31, 2**63, 10**400, 1.0, -1, None])
def test_a_step_is_a_whole_number_a_32_bit_column_holds(step: object) -> None:
    assert parse_progress_line(json.dumps({"step": step, "metrics": {"loss": 1.0}})) is None
    assert isinstance(parse_progress_line(json.dumps({"step": 2**31 - 1})), ProgressRecord)


def test_an_unusable_attempt_or_total_costs_that_field_not_the_line() -> None:
    record = parse_progress_line('{"step":1,"total":true,"attempt":2147483648,"metrics":{"a":1}}')
    assert isinstance(record, ProgressRecord)
    assert record.total is None and record.attempt is None and record.metrics == {"a": 1.0}


def test_a_line_records_its_first_metrics_whose_names_the_ledger_can_hold() -> None:
    """A job writes its progress file: a line naming thousands of metrics costs the ledger 64 rows."""
    long = "x" * (MAX_METRIC_NAME_CHARS + 1)
    metrics = {long: 1.0, "x" * MAX_METRIC_NAME_CHARS: 2.0, **{f"m{i}": float(i) for i in range(10_000)}}
    record = parse_progress_line(json.dumps({"step": 1, "metrics": metrics}))
    assert isinstance(record, ProgressRecord) and len(record.metrics) == MAX_METRICS_PER_LINE == 64
    assert list(record.metrics) == ["x" * MAX_METRIC_NAME_CHARS, *(f"m{i}" for i in range(63))]


def test_a_checkpoint_note_keeps_as_many_metrics_as_a_job_may_name() -> None:
    note = {"step": 1, "metrics": {f"m{i}": 1.0 for i in range(1000)}}
    assert list(parse_checkpoint_note(json.dumps(note))) == [f"m{i}" for i in range(MAX_METRIC_NAMES)]


def test_a_torn_line_is_refused_and_its_whole_form_is_read() -> None:
    line = '{"step":4,"metrics":{"loss":0.5},"time":1.5}'
    assert all(parse_progress_line(line[:cut]) is None for cut in range(len(line)))
    assert parse_progress_line(line) == ProgressRecord(step=4, metrics={"loss": 0.5}, time=1.5)


def test_a_checkpoint_line_needs_only_a_path_without_nul() -> None:
    record = parse_progress_line('{"checkpoint":"/x/c.pt","step":"8","time":NaN,"attempt":false}')
    assert record == CheckpointRecord(checkpoint="/x/c.pt")  # the rest unusable, the path kept
    unusable = '{"checkpoint":null,"step":5,"metrics":{"a":1}}'
    assert parse_progress_line(unusable) is None  # nor is it taken for a progress line


def test_latest_checkpoint_ignores_temp_files_and_checkpoints_without_their_note(tmp_path: Path) -> None:
    files = JobFiles(tmp_path)
    assert files.latest_checkpoint() is None
    files.checkpoints.mkdir()
    for step in (8, 16, 100):
        files.checkpoint_file(step).write_bytes(b"")
        files.checkpoint_note(files.checkpoint_file(step)).write_text("{}")
    (files.checkpoints / ".ckpt-00000200.pt.tmp-1").write_bytes(b"")  # killed before the rename
    files.checkpoint_file(300).write_bytes(b"")  # killed between the rename and the note
    files.checkpoint_note(files.checkpoint_file(400)).write_text("{}")  # a note alone
    assert files.latest_checkpoint() == files.checkpoints / "ckpt-00000100.pt"
    assert [step for step, _ in files.saved_checkpoints()] == [8, 16, 100]


# ---------------------------------------------------------------- placement: where each rank runs


def test_a_rank_says_where_it_runs_and_the_service_reads_it_back(tmp_path: Path) -> None:
    files = JobFiles(tmp_path)
    write_placement(files.placement(1), attempt=2, rank=1, local_rank=1, gpu="3")

    placed = parse_placement(files.placement(1).read_text(), attempt=2)

    here = node_hardlinks_protected()
    assert placed == RankPlacement(
        rank=1, host=socket.gethostname(), local_rank=1, gpu="3", protected_hardlinks=here, pid=os.getpid()
    )
    assert parse_placement(files.placement(1).read_text(), attempt=1) is None  # another attempt's


@pytest.mark.parametrize(
    "record",
    [
        {"attempt": 1, "rank": -1, "host": "n1", "local_rank": 0},
        {"attempt": 1, "rank": 0, "host": "", "local_rank": 0},
        {"attempt": 1, "rank": 0, "host": "n\x001", "local_rank": 0},
        {"attempt": 1, "rank": 0, "host": "n" * 256, "local_rank": 0},
        {"attempt": 1, "rank": 0, "host": ["n1"], "local_rank": 0},
        {"attempt": 1, "rank": True, "host": "n1", "local_rank": 0},
        {"rank": 0, "host": "n1", "local_rank": 0},
        [0, "n1"],
    ],
)
def test_an_unusable_placement_is_no_placement(record: object) -> None:
    assert parse_placement(json.dumps(record), attempt=1) is None


def test_a_gpu_that_is_not_short_text_is_left_out() -> None:
    record = {"attempt": 1, "rank": 0, "host": "n1", "local_rank": 0, "gpu": {"id": 0}}
    assert parse_placement(json.dumps(record), attempt=1) == RankPlacement(rank=0, host="n1", local_rank=0)
    assert parse_placement("{torn", attempt=1) is None


@pytest.mark.parametrize(("setting", "said"), [("1\n", True), ("0\n", False), ("2\n", None), (None, None)])
def test_a_rank_says_whether_its_node_protects_hard_links(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str | None, said: bool | None
) -> None:
    """SLURM ranks make their links on the compute nodes, whose fs.protected_hardlinks the service's
    own host cannot see: each rank writes its node's in the placement file."""
    node = tmp_path / "protected_hardlinks"
    if setting is not None:
        node.write_text(setting)
    assert node_hardlinks_protected(node) is said
    monkeypatch.setattr(files_module, "node_hardlinks_protected", lambda: node_hardlinks_protected(node))
    write_placement(tmp_path / "rank0.json", attempt=1, rank=0, local_rank=0, gpu=None)
    placed = parse_placement((tmp_path / "rank0.json").read_text(), attempt=1)
    assert placed is not None and placed.protected_hardlinks is said


def test_a_placement_from_an_older_worker_or_with_a_bad_value_still_parses() -> None:
    old = {"attempt": 1, "rank": 0, "host": "n1", "local_rank": 0, "gpu": None}
    assert parse_placement(json.dumps(old), attempt=1) == RankPlacement(rank=0, host="n1", local_rank=0)
    for bad in (1, "yes", [True]):
        placed = parse_placement(json.dumps({**old, "protected_hardlinks": bad}), attempt=1)
        assert placed == RankPlacement(rank=0, host="n1", local_rank=0, protected_hardlinks=None)
