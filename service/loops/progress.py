"""Rank 0's progress file into the ledger, incrementally (only lines not yet read).

The supervisor's restarts.jsonl is read with it (service.loops.restarts).
Reading and parsing is service.jobfs (with the worker's one parser); this module writes:
metric rows (and their rollup buckets, service.domain.metric_series), the job's latest progress and
checkpoint, and how far the file has been read. A job is untrusted and writes as much as it likes, so
what it costs the ledger is bounded:
- a series (a metric of an attempt) holds one value per step: a step reported again replaces it;
- a job names its metrics, so it could name a new one in every line: the first MAX_METRIC_NAMES
  names it reports are recorded, and new names after them are dropped (the parser already keeps a
  line to its first metrics and the ledger's name length);
- one read takes the lines up to MAX_METRIC_ROWS_PER_READ values (the rest wait for the next tick);
- a job keeps at most MAX_METRIC_ROWS values: past them its progress is still shown, but no more
  values are recorded, and its reason says so.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import delete
from sqlmodel import Session, col

from service.domain import goodput, metric_series
from service.domain.transitions import record_transition
from service.domain.watchdog import recent_report_times
from service.jobfs import read_new_progress
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric
from service.loops.restarts import ingest_restarts
from service.states import JobState
from worker.spec import MAX_METRIC_NAMES, CheckpointRecord, ProgressRecord

log = logging.getLogger(__name__)
MAX_METRIC_ROWS_PER_READ = 20_000
MAX_METRIC_ROWS = 1_000_000
# Jobs already said to have dropped names, so that the service log says it once per job (per run),
# not once per tick for as long as the job goes on reporting them.
_TOLD: set[int] = set()


def ingest_progress(session: Session, job: Job, path: Path) -> bool:
    """Add new metric rows and the latest progress to `job`, then its supervisor's new restart records
    (service.loops.restarts: the first report after a restart ends its downtime). Returns True when
    any progress was read."""
    read = _ingest(session, job, path)
    ingest_restarts(session, job)
    return read


def _ingest(session: Session, job: Job, path: Path) -> bool:
    read = read_new_progress(path, job.progress_offset, MAX_METRIC_ROWS_PER_READ)
    if read is None:
        return False
    records, job.progress_offset = read
    latest: ProgressRecord | None = None
    added: list[JobMetric] = []
    reported: list[float] = []  # the reports' own times (rank 0's clock): the job's pace
    for record in records:
        if isinstance(record, CheckpointRecord):  # a checkpoint note, not a progress report
            job.latest_checkpoint = record.checkpoint
            goodput.note_checkpoint(job, record.checkpoint, record.time)
        else:
            latest = record
            added.extend(_metrics(job, record))
            if record.time is not None:
                reported.append(record.time)
    if latest is not None:
        job.progress = latest.shown
    if records:  # progress, for the watchdog (service.domain.watchdog): a report or a checkpoint
        job.progress_at = utcnow()
        if reported:
            job.report_times = recent_report_times(job.report_times, reported)
    session.add(job)  # stamped by the ledger clock at commit, like every change to a job
    added = _within_limits(session, job, _last_of_each_step(added))
    if added:
        assert job.id is not None
        _forget_replaced(session, job.id, added)
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


def _last_of_each_step(rows: list[JobMetric]) -> list[JobMetric]:
    """One row per series and step: the last reported."""
    return list({(row.name, row.attempt, row.step): row for row in rows}.values())


def _forget_replaced(session: Session, job_id: int, rows: list[JobMetric]) -> None:
    """Delete the stored values of the steps these rows report again (one statement per series)."""
    steps: dict[tuple[str, int], list[int]] = {}
    for row in rows:
        steps.setdefault((row.name, row.attempt), []).append(row.step)
    for (name, attempt), reported in steps.items():
        session.execute(
            delete(JobMetric).where(
                col(JobMetric.job_id) == job_id,
                col(JobMetric.name) == name,
                col(JobMetric.attempt) == attempt,
                col(JobMetric.step).in_(reported),
            ),
            execution_options={"synchronize_session": False},
        )


def _within_limits(session: Session, job: Job, rows: list[JobMetric]) -> list[JobMetric]:
    """`rows` less those of new names past the job's first MAX_METRIC_NAMES (first come, first kept),
    and none once the job holds MAX_METRIC_ROWS values."""
    if not rows:
        return rows
    assert job.id is not None
    stored = metric_series.series_sizes(session.connection(), job.id)
    held = sum(stored.values())
    if held + len(rows) > MAX_METRIC_ROWS:
        if held < MAX_METRIC_ROWS:  # said once, as the job reaches the limit
            record_transition(
                session, job, JobState(job.state),
                f"reports more than {MAX_METRIC_ROWS:,} metric values: its progress is still shown, "
                "its later values are not recorded",
            )  # fmt: skip
        rows = rows[: max(MAX_METRIC_ROWS - held, 0)]
    known = set(stored)
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
