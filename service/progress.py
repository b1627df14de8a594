"""Reads rank 0's progress file into the ledger, incrementally (only lines not yet read)."""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlmodel import Session

from service.models import Job, JobMetric, utcnow

log = logging.getLogger(__name__)

MAX_READ = 4 * 1024 * 1024  # one tick reads at most this much; the rest waits for the next


def ingest_progress(session: Session, job: Job, path: Path) -> bool:
    """Add new metric rows and the latest progress to `job`. Returns True when anything was read."""
    try:
        with path.open("rb") as handle:
            handle.seek(job.progress_offset)
            chunk = handle.read(MAX_READ)
    except FileNotFoundError:
        return False
    end = chunk.rfind(b"\n")
    if end < 0:
        return False  # no complete line yet: rank 0 is mid-write
    complete = chunk[: end + 1]
    job.progress_offset += len(complete)
    latest: dict[str, Any] | None = None
    for raw in complete.splitlines():
        line = _parse(raw)
        if line is None:
            continue
        if "checkpoint" in line:  # a checkpoint note, not a progress report
            job.latest_checkpoint = str(line["checkpoint"])
        elif "step" in line:
            latest = line
            _add_metrics(session, job, line)
    if latest is not None:
        job.progress = {k: latest.get(k) for k in ("step", "total", "metrics", "time", "attempt")}
    job.updated_at = utcnow()
    session.add(job)
    return True


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        log.warning("skipping a malformed progress line: %r", raw[:200])
        return None
    return value if isinstance(value, dict) else None


def _add_metrics(session: Session, job: Job, line: dict[str, Any]) -> None:
    assert job.id is not None
    metrics = line.get("metrics") or {}
    if not isinstance(metrics, dict):
        return
    when = _time(line.get("time"))
    step = int(line["step"])
    attempt = int(line.get("attempt") or job.attempt)
    for name, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            continue
        session.add(
            JobMetric(
                job_id=job.id, step=step, name=str(name)[:100], value=float(value), attempt=attempt, time=when
            )
        )


def _time(value: Any) -> datetime:
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, tz=timezone.utc)
    return utcnow()
