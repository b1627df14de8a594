"""ingest_progress writes what the worker's parser read: metric rows, the latest progress, the offset.

The job's `updated_at` is the ledger clock's stamp at commit, for a tick that only moved the offset too.
"""

from __future__ import annotations

import time
from pathlib import Path

from sqlalchemy.engine import Engine
from sqlmodel import select

from service.ledger.db import session_scope, write_scope
from service.ledger.models import Job, JobMetric
from service.loops.progress import ingest_progress


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
