"""A job's goodput: its wall time split into training that was kept, restart downtime, work recomputed
after a loss, and queue wait. `split` is pure (a history in, seconds out); `refresh` gathers the
history from the ledger and keeps the result on the job row, where its public JSON is made from.

- queue: time in queued, submitted, pending, retrying or requeued (every attempt's wait);
- downtime: for each restart in place, from the loss (`lost_at`) to the first step reported after the
  new run started (up to now, or the attempt's end, while there is none);
- recomputed: for each restart, the time trained since the checkpoint it resumed from (its save time:
  the metric reported at that step), up to the loss; from the lost run's start when it resumed from
  none, or from a checkpoint older than that run;
- training: the time running, less downtime and recomputed work.
Times are epoch seconds; the records' times are the job's clock (rank 0's, the supervisor's), the
states' the service's: each part is kept to what the running time allows, never below zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import func
from sqlalchemy import select as core_select
from sqlmodel import Session, col, select

from service.ledger.models.goodput import GOODPUT_PARTS, Goodput, GoodputPart
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job
from service.states import JobState, is_terminal

QUEUE_STATES = frozenset(
    {JobState.queued, JobState.submitted, JobState.pending, JobState.retrying, JobState.requeued}
)


@dataclass(frozen=True)
class Span:
    """One restart in place, as goodput needs it."""

    lost_at: float
    run_start: float  # when the lost run started (the attempt's start, or the restart before's)
    checkpoint_at: float | None = None  # when the checkpoint it resumed from was saved (None: none)
    first_step_at: float | None = None  # the first step reported after the restart (None: none yet)


def split(states: Sequence[tuple[float, JobState]], restarts: Sequence[Span], now: float) -> Goodput:
    """The parts of the wall time from the job's states (each (time, state entered), in order; the
    last one lasts until `now` unless it ends the job) and its restarts."""
    running = queue = 0.0
    end = now  # the job's end: its first terminal state
    for index, (at, state) in enumerate(states):
        if is_terminal(state):
            end = at
            break
        until = states[index + 1][0] if index + 1 < len(states) else now
        lasted = max(0.0, until - at)
        if state is JobState.running:
            running += lasted
        elif state in QUEUE_STATES:
            queue += lasted
    downtime = recomputed = 0.0
    for span in restarts:
        back = span.first_step_at if span.first_step_at is not None else end
        downtime += max(0.0, min(back, end) - span.lost_at)
        since = span.run_start if span.checkpoint_at is None else max(span.checkpoint_at, span.run_start)
        recomputed += max(0.0, span.lost_at - since)
    downtime = min(downtime, running)
    recomputed = min(recomputed, running - downtime)
    training = running - downtime - recomputed
    wall = running + queue
    last = states[-1][1] if states else None
    return Goodput(
        training_s=round(training, 3),
        downtime_s=round(downtime, 3),
        recomputed_s=round(recomputed, 3),
        queue_s=round(queue, 3),
        ratio=round(training / wall, 4) if wall > 0 else None,
        as_of=datetime.fromtimestamp(now, tz=timezone.utc),
        accruing=_accruing(last, restarts),
    )


def _accruing(state: JobState | None, restarts: Sequence[Span]) -> GoodputPart | None:
    if state is JobState.running:
        return "downtime" if restarts and restarts[-1].first_step_at is None else "training"
    return "queue" if state in QUEUE_STATES else None


def spans(log: list[dict[str, Any]] | None) -> list[Span]:
    """The restarts in place of a job's restart_log (service.domain.restarts), as goodput needs them."""
    found = []
    for one in log or []:
        lost_at, run_start = one.get("lost_at"), one.get("run_start")
        if one.get("outcome") != "restarted" or lost_at is None:
            continue
        found.append(
            Span(
                lost_at=float(lost_at),
                run_start=float(run_start if run_start is not None else lost_at),
                checkpoint_at=one.get("checkpoint_at"),
                first_step_at=one.get("first_step_at"),
            )
        )
    return found


SAVED = "checkpoints"  # in Job.goodput, beside the parts: when the job's latest checkpoints were saved
MAX_SAVED = 8


def note_checkpoint(job: Job, path: str, saved_at: float | None) -> None:
    """Rank 0 saved `path` at `saved_at` (its clock): a restart that resumes from it recomputes what
    was trained since. The newest MAX_SAVED are kept."""
    if saved_at is None:
        return
    kept = dict((job.goodput or {}).get(SAVED) or {})
    kept.pop(path, None)
    kept[path] = saved_at
    job.goodput = {**(job.goodput or {}), SAVED: dict(list(kept.items())[-MAX_SAVED:])}


def saved_at(job: Job, path: str | None) -> float | None:
    """When the checkpoint `path` was saved, if the job's progress said so (note_checkpoint)."""
    found = ((job.goodput or {}).get(SAVED) or {}).get(path) if path else None
    return float(found) if isinstance(found, int | float) else None


def refresh(session: Session, job: Job, now: datetime) -> None:
    """Work the job's goodput out again, as of `now`, from its state changes and its restarts."""
    query = select(JobEvent.time, JobEvent.to_state).where(JobEvent.job_id == job.id)
    with session.no_autoflush:
        rows = session.exec(query.order_by(col(JobEvent.id))).all()
    states = [(at.timestamp(), JobState(state)) for at, state in rows]
    if not states or states[-1][1] is not JobState(job.state):  # the move being made, not flushed yet
        states.append((now.timestamp(), JobState(job.state)))
    parts = split(states, spans(job.restart_log), now.timestamp()).model_dump(mode="json")
    saved = (job.goodput or {}).get(SAVED)
    job.goodput = {**parts, SAVED: saved} if saved else parts
    session.add(job)


def totals(session: Session) -> tuple[dict[GoodputPart, float], int]:
    """Every job's goodput seconds by part, as last worked out, summed; and the restarts in place of
    every job (for /metrics: one query, no label per job)."""
    column = col(Job.goodput)
    sums = [func.coalesce(func.sum(column[f"{part}_s"].as_float()), 0.0) for part in GOODPUT_PARTS]
    row = session.execute(core_select(*sums, func.coalesce(func.sum(col(Job.restart_count)), 0))).one()
    return dict(zip(GOODPUT_PARTS, (float(value) for value in row[:-1]), strict=True)), int(row[-1])
