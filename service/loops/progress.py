"""Reads rank 0's progress file into the ledger, incrementally (only lines not yet read)."""

from __future__ import annotations

import json
import logging
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlmodel import Session

from service.ledger.models import Job, JobMetric, utcnow

log = logging.getLogger(__name__)

MAX_READ = 4 * 1024 * 1024  # one tick reads at most this much; the rest waits for the next
MAX_COUNT = 2**31 - 1  # steps and attempts live in INTEGER columns


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
            if isinstance(line["checkpoint"], str) and "\x00" not in line["checkpoint"]:
                job.latest_checkpoint = line["checkpoint"]
        elif (step := _count(line.get("step"))) is not None:
            latest = line
            _add_metrics(session, job, step, line)
    if latest is not None:
        job.progress = _finite({k: latest.get(k) for k in ("step", "total", "metrics", "time", "attempt")})
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


def _add_metrics(session: Session, job: Job, step: int, line: dict[str, Any]) -> None:
    assert job.id is not None
    metrics = line.get("metrics") or {}
    if not isinstance(metrics, dict):
        return
    when = _time(line.get("time"))
    attempt = _count(line.get("attempt")) or job.attempt
    for name, raw in metrics.items():
        value = _metric_value(raw)
        if value is None or "\x00" in name:  # a number we can store, under a name PostgreSQL takes
            continue
        session.add(
            JobMetric(job_id=job.id, step=step, name=str(name)[:100], value=value, attempt=attempt, time=when)
        )


def _metric_value(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return number if math.isfinite(number) else None


def _count(value: Any) -> int | None:
    """A step or attempt number the ledger can store (an INTEGER column), else None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        return None
    return value


def _time(value: Any) -> datetime:
    """The line's own time when it is a usable epoch time, else now."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        try:
            return datetime.fromtimestamp(value, tz=timezone.utc)
        except (OverflowError, OSError, ValueError):
            pass
    return utcnow()


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities replaced by None: JSON (PostgreSQL's json type) has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value
