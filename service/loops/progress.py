"""Rank 0's progress file into the ledger, incrementally (only lines not yet read).

Reading and parsing is service.domain.job_files (with the worker's one parser); this module writes:
metric rows (and their rollup buckets, service.domain.metric_series), the job's latest progress and
checkpoint, and how far the file has been read.
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from sqlmodel import Session

from service.domain import metric_series
from service.domain.job_files import read_new_progress
from service.ledger.models import Job, JobMetric, utcnow
from worker.spec import CheckpointRecord, ProgressRecord

METRIC_NAME_LENGTH = 100  # the JobMetric.name column


def ingest_progress(session: Session, job: Job, path: Path) -> bool:
    """Add new metric rows and the latest progress to `job`. Returns True when anything was read."""
    read = read_new_progress(path, job.progress_offset)
    if read is None:
        return False
    records, job.progress_offset = read
    latest: ProgressRecord | None = None
    added: list[JobMetric] = []
    for record in records:
        if isinstance(record, CheckpointRecord):  # a checkpoint note, not a progress report
            job.latest_checkpoint = record.checkpoint
        else:
            latest = record
            added.extend(_metrics(job, record))
    if latest is not None:
        job.progress = latest.shown
    session.add(job)  # stamped by the ledger clock at commit, like every change to a job
    if added:
        assert job.id is not None
        session.add_all(added)
        session.flush()  # the rollup is rebuilt from the rows, so they must be in the database
        series = ((m.name, m.attempt, m.step) for m in added)
        metric_series.refresh_added(session.connection(), job.id, series)
    return True


def _metrics(job: Job, record: ProgressRecord) -> list[JobMetric]:
    assert job.id is not None
    when = _time(record.time)
    attempt = record.attempt or job.attempt
    return [
        JobMetric(
            job_id=job.id,
            step=record.step,
            name=name[:METRIC_NAME_LENGTH],
            value=value,
            attempt=attempt,
            time=when,
        )
        for name, value in record.metrics.items()
        if value is not None
    ]


def _time(epoch: float | None) -> datetime:
    """The line's own time when it is a usable epoch time, else now."""
    if epoch is not None:
        try:
            return datetime.fromtimestamp(epoch, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            pass
    return utcnow()
