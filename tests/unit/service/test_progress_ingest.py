"""ingest_progress writes what the worker's parser read: metric rows, the latest progress, the offset.

The job's `updated_at` is the ledger clock's stamp at commit, for a tick that only moved the offset too.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import select

from service.ledger.db import session_scope, write_scope
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric
from service.loops import progress
from service.loops.progress import ingest_progress
from worker.spec import MAX_METRIC_NAMES


def _job(engine: Engine) -> Job:
    with write_scope(engine) as session:
        job = Job(name="p", backend="local", spec={"entrypoint": "worker.tasks.faults:sleep"})
        session.add(job)
    return job


def _ingest(engine: Engine, job_id: int | None, path: Path) -> tuple[bool, Job]:
    with write_scope(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        read = ingest_progress(session, job, path)
    return read, job


def test_a_tick_that_only_moves_the_offset_still_stamps_the_job(engine: Engine, tmp_path: Path) -> None:
    job = _job(engine)
    path = tmp_path / "progress.jsonl"
    path.write_text("not json\n\n")

    read, after = _ingest(engine, job.id, path)

    assert read and after.progress_offset == len("not json\n\n") and after.progress is None
    assert after.updated_at > job.updated_at
    assert _ingest(engine, job.id, path)[0] is False  # nothing new: nothing read, nothing written


def test_a_line_without_time_is_stamped_now_and_shown_as_written(engine: Engine, tmp_path: Path) -> None:
    job = _job(engine)
    path = tmp_path / "progress.jsonl"
    path.write_text('{"step":2,"total":"ten","metrics":{"loss":1,"word":"low","bad":NaN}}\n{"step":3')
    before = time.time()

    read, after = _ingest(engine, job.id, path)

    assert read and after.progress_offset == path.read_bytes().index(b"\n") + 1  # the torn line waits
    shown = {"step": 2, "total": "ten", "metrics": {"loss": 1, "word": "low", "bad": None}, "time": None}
    assert after.progress == {**shown, "attempt": None}
    with session_scope(engine) as session:
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id)).all()
    assert [(row.step, row.name, row.value, row.attempt) for row in rows] == [(2, "loss", 1.0, job.attempt)]
    assert rows[0].time.timestamp() >= before - 1


def test_a_job_records_the_first_metrics_of_a_line_and_its_first_names_only(
    engine: Engine, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job writes its progress file: naming thousands of metrics must not cost thousands of rows
    and series per line, so a line keeps its first 64 metrics and a job its first 256 names."""
    monkeypatch.setattr(progress, "_TOLD", set())  # another ledger's job may have had this id
    job = _job(engine)
    path = tmp_path / "progress.jsonl"
    lines = [{"step": 0, "metrics": {f"n{i}": 1.0 for i in range(10_000)}}]  # its first 64 are kept
    lines += [{"step": s, "metrics": {f"s{s}_{i}": 1.0 for i in range(64)}} for s in range(1, 5)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))

    _ingest(engine, job.id, path)
    later = {"step": 9, "metrics": {"n0": 2.0, "s3_63": 2.0, "s4_0": 2.0, "new": 2.0}}
    with path.open("a") as more:  # a later tick: stored names go on, new ones stay out
        more.write(json.dumps(later) + "\n")
    _ingest(engine, job.id, path)

    with session_scope(engine) as session:
        rows = session.exec(select(JobMetric).where(JobMetric.job_id == job.id)).all()
    names = [f"n{i}" for i in range(64)] + [f"s{s}_{i}" for s in range(1, 5) for i in range(64)]
    assert len({row.name for row in rows}) == MAX_METRIC_NAMES == 256
    assert {row.name for row in rows} == set(names[:MAX_METRIC_NAMES])  # s4_*: the 257th name on
    assert [(row.name, row.value) for row in rows if row.step == 9] == [("n0", 2.0), ("s3_63", 2.0)]
    assert caplog.text.count("reports more than 256 metric names") == 1  # said once, not every tick


def _rows(engine: Engine, job_id: int | None) -> list[tuple[str, int, float]]:
    with session_scope(engine) as session:
        found = session.exec(select(JobMetric).where(JobMetric.job_id == job_id)).all()
        return sorted((row.name, row.step, row.value) for row in found)


def test_a_step_reported_again_replaces_its_value(engine: Engine, tmp_path: Path) -> None:
    """A series holds one value per step, so a job that repeats one step costs one row, and the
    rollup's refresh of that step reads one row, however often it is repeated."""
    job = _job(engine)
    path = tmp_path / "progress.jsonl"
    path.write_text("".join(json.dumps({"step": 5, "metrics": {"loss": n}}) + "\n" for n in range(1000)))
    _ingest(engine, job.id, path)
    with path.open("a") as more:
        more.write(json.dumps({"step": 5, "metrics": {"loss": -1}}) + "\n")
        more.write(json.dumps({"step": 6, "metrics": {"loss": 0.5}}) + "\n")
    _ingest(engine, job.id, path)

    assert _rows(engine, job.id) == [("loss", 5, -1.0), ("loss", 6, 0.5)]


def test_one_read_takes_a_bounded_number_of_values_and_the_next_goes_on(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "MAX_METRIC_ROWS_PER_READ", 100)
    job = _job(engine)
    path = tmp_path / "progress.jsonl"
    lines = [json.dumps({"step": step, "metrics": {f"m{i}": 1.0 for i in range(10)}}) for step in range(25)]
    path.write_text("\n".join(lines) + "\n")

    _, first = _ingest(engine, job.id, path)
    assert len(_rows(engine, job.id)) == 100 and first.progress == json.loads(lines[9]) | {
        "total": None, "time": None, "attempt": None
    }  # fmt: skip
    assert first.progress_offset == sum(len(line) + 1 for line in lines[:10])  # a line's end
    _ingest(engine, job.id, path)
    _, last = _ingest(engine, job.id, path)
    assert len(_rows(engine, job.id)) == 250 and last.progress_offset == path.stat().st_size


def test_past_its_limit_a_job_s_progress_is_shown_and_its_values_are_not_kept(
    engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "MAX_METRIC_ROWS", 30)
    job = _job(engine)
    path = tmp_path / "progress.jsonl"
    path.write_text(
        "".join(json.dumps({"step": step, "metrics": {"a": 1, "b": 2}}) + "\n" for step in range(20))
    )
    _ingest(engine, job.id, path)
    with path.open("a") as more:
        more.write(json.dumps({"step": 99, "metrics": {"a": 3}}) + "\n")
    _, after = _ingest(engine, job.id, path)

    assert len(_rows(engine, job.id)) == 30
    assert after.progress is not None and after.progress["step"] == 99
    assert after.reason is not None and "more than 30 metric values" in after.reason
