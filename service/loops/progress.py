"""Rank 0's progress file into the ledger, incrementally (only lines not yet read).

Reading and parsing is service.domain.job_files (with the worker's one parser); this module writes:
metric rows (and their rollup buckets, service.domain.metric_series), the job's latest progress and
checkpoint, and how far the file has been read. A job names its metrics, so it could name a new one
in every line: the first MAX_METRIC_NAMES names it reports are recorded, and new names after them are
dropped (the parser already keeps a line to its first metrics and the ledger's name length).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path

from sqlmodel import Session

from service.domain import metric_series
from service.domain.job_files import read_new_progress
from service.ledger.models import Job, JobMetric, utcnow
from worker.spec import MAX_METRIC_NAMES, CheckpointRecord, ProgressRecord

log = logging.getLogger(__name__)
# Jobs already said to have dropped names, so that the service log says it once per job (per run),
# not once per tick for as long as the job goes on reporting them.
_TOLD: set[int] = set()


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
    added = _within_name_limit(session, job, added)
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
            name=name,
            value=value,
            attempt=attempt,
            time=when,
        )
        for name, value in record.metrics.items()
        if value is not None
    ]


def _within_name_limit(session: Session, job: Job, rows: list[JobMetric]) -> list[JobMetric]:
    """`rows` less those of new names past the job's first MAX_METRIC_NAMES (first come, first kept)."""
    if not rows:
        return rows
    assert job.id is not None
    known = metric_series.series_names(session.connection(), job.id)
    new = [name for name in dict.fromkeys(row.name for row in rows) if name not in known]
    room = max(MAX_METRIC_NAMES - len(known), 0)
    if len(new) <= room:
        return rows
    kept = known.union(new[:room])
    allowed = [row for row in rows if row.name in kept]
    if job.id not in _TOLD:
        _TOLD.add(job.id)
        log.warning(
            "job %s reports more than %d metric names: %d new ones dropped (%d values), and any later",
            job.id,
            MAX_METRIC_NAMES,
            len(new) - room,
            len(rows) - len(allowed),
        )
    return allowed


def _time(epoch: float | None) -> datetime:
    """The line's own time when it is a usable epoch time, else now."""
    if epoch is not None:
        try:
            return datetime.fromtimestamp(epoch, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            pass
    return utcnow()
