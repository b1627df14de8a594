"""Stacks on demand: every rank of a running job writes the stacks of all its threads, and the service
reads, groups and keeps them (the last capture of each attempt).

The ranks write them themselves (worker.stacks: faulthandler on SIGURG, a C handler that needs neither
the GIL nor the rank's Python thread, so a rank stuck in C code or in a collective answers too). The
service notes each rank's stacks file size, has the backend send the signal as the job's account (one
call per job), waits until every rank's file grew (or WAIT_S passed), and reads only the new bytes,
bounded (service.jobfs), parsed and grouped by the pure service.domain.stacks.

No transaction is open while the ranks are waited for: the job is read in one short transaction, the
capture stored in another. Who captures when (one capture per job, a few per user, fair turns by
owner, a total deadline) is service.domain.captures's; this module makes one capture, on its thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, col, select

from service.backends.base import Backend, StackRequest
from service.domain import audit, stacks
from service.domain.auth import Principal
from service.domain.jobs import get_job, require_backend
from service.errors import Conflict
from service.jobfs import StackText, read_activity, read_flight_records, read_stack_texts, stack_sizes
from service.ledger.db import session_scope, write_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.stacks import StackCapture, StackCapturePublic, Trigger
from service.states import JobState

log = logging.getLogger(__name__)

WAIT_S = 3.0  # the most a capture waits for the ranks to write
POLL_S = 0.05  # how often the stacks files' sizes are looked at meanwhile
STACK_BYTES = 64 * 1024  # the most read of one rank's capture
UNREADABLE_DUMP = "its NCCL flight recorder dump could not be read (not a dump, or past the reader's bounds)"


@dataclass(frozen=True)
class _Target:
    """What a capture needs of the job, read in one short transaction."""

    job_id: int
    attempt: int
    backend: str
    request: StackRequest
    folder: Path
    world: int
    hosts: dict[int, str]


@dataclass(frozen=True)
class Asked:
    """What a stacks request asked of a job the viewer may see, read in one short transaction."""

    job_id: int
    owner: str
    state: JobState
    capture: bool  # capture now (the job runs), else answer the last capture kept
    last: StackCapturePublic | None


def asked(engine: Engine, job_id: int, viewer: Principal, capture: bool | None) -> Asked:
    """Read what GET /api/v1/jobs/{id}/stacks needs before any capture: NotFound for a job `viewer`
    may not see (stacks may hold data from the job's memory: its owner and admins only); Conflict
    for a capture asked of a job that is not running. An admin's read of another's job is audited."""
    with session_scope(engine) as session:
        job = get_job(session, job_id, viewer)
        state, owner = JobState(job.state), job.owner
        last = last_capture(session, job_id)
    if owner != viewer.user:  # an admin reading what may be another user's memory: on the record
        with write_scope(engine) as session:
            audit.record(session, viewer.user, "job.stacks", f"job {job_id}", f"owner={owner}")
    if capture is None:
        capture = state is JobState.running
    if capture and state is not JobState.running:
        raise Conflict(
            f"job {job_id} is {state.value}: stacks are captured from a running job only"
            + ("; its last capture is shown without ?capture=1" if last else ""),
            field="capture",
        )
    return Asked(job_id, owner, state, capture, last)


def kept(engine: Engine, asking: Asked, reread: bool) -> StackCapturePublic:
    """The last capture kept (read again when `reread`: a capture was tried meanwhile), or Conflict."""
    last = asking.last
    if reread:
        with session_scope(engine) as session:
            last = last_capture(session, asking.job_id)
    if last is None:
        running = asking.state is JobState.running
        why = "its ranks could not be signalled" if running else "it is not running"
        raise Conflict(
            f"job {asking.job_id} has no stacks captured, and {why} ({asking.state.value})", field="job_id"
        )
    return last


def last_capture(session: Session, job_id: int) -> StackCapturePublic | None:
    """The job's latest attempt's last capture, or None."""
    query = (
        select(StackCapture)
        .where(StackCapture.job_id == job_id)
        .order_by(col(StackCapture.attempt).desc())
        .limit(1)
    )
    row = session.exec(query).first()
    return None if row is None else _public(row, fresh=False)


# ---------------------------------------------------------------- one capture


def capture_now(
    engine: Engine, backends: Mapping[str, Backend], job_id: int, trigger: Trigger, deadline: float
) -> StackCapturePublic | None:
    """Capture the stacks of every rank of this job now, store them as its attempt's last capture and
    return them; None when the job is not running (or its ranks could not be signalled: it ended
    meanwhile). The ranks are waited for WAIT_S at most, and never past `deadline` (monotonic). No
    visibility check, no limit: the caller (service.domain.captures) has made them."""
    with session_scope(engine) as session:  # read, and the transaction closed before the signal
        target = _target(session, job_id)
    if target is None:
        return None
    backend = require_backend(backends, target.backend)
    before = stack_sizes(target.folder, target.world)
    started = time.monotonic()
    if not backend.signal_stacks(target.request):
        log.info("job %d: its ranks could not be signalled for their stacks", job_id)
        return None
    after = _wait_for_ranks(target, before, min(started + WAIT_S, deadline))
    took = time.monotonic() - started
    texts = read_stack_texts(target.folder, before, STACK_BYTES)
    row = _parsed(target, _hosts(target), before, after, texts, trigger, took)
    _store(engine, row)
    log.info("job %d: stacks of %d rank(s) captured in %.2f s (%s)", job_id, target.world, took, trigger)
    return _public(row, fresh=True)


def _target(session: Session, job_id: int) -> _Target | None:
    job = session.get(Job, job_id)
    if job is None or JobState(job.state) is not JobState.running:
        return None
    if job.external_id is None or job.folder is None:
        return None
    python = job.spec.get("python")
    request = StackRequest(job.external_id, job.run_as, python if isinstance(python, str) else None)
    hosts = {}
    for placed in job.placement or []:
        if isinstance(placed, dict) and isinstance(placed.get("rank"), int) and placed.get("host"):
            hosts[placed["rank"]] = str(placed["host"])
    attempt = job.run_attempt or job.attempt
    return _Target(job_id, attempt, job.backend, request, Path(job.folder), job.resources.world_size, hosts)


def _wait_for_ranks(target: _Target, before: dict[int, int], deadline: float) -> dict[int, int]:
    """The sizes once every rank's file grew and stood still for a poll (faulthandler writes a dump in
    many small writes), or as they are at the deadline."""
    sizes = before
    while True:
        time.sleep(POLL_S)
        now = stack_sizes(target.folder, target.world)
        grew = all(now.get(rank, 0) > before.get(rank, 0) for rank in range(target.world))
        if (grew and now == sizes) or time.monotonic() >= deadline:
            return now
        sizes = now


def _hosts(target: _Target) -> dict[int, str]:
    """Each rank's host: its placement in the ledger, else what its activity file says (a rank whose
    placement the reconciler has not read yet)."""
    if len(target.hosts) >= target.world:
        return target.hosts
    activity = read_activity(target.folder, target.world, target.attempt)
    found = {one.rank: one.host for one in activity if one.host}
    return {**found, **target.hosts}


def _parsed(
    target: _Target,
    hosts: dict[int, str],
    before: dict[int, int],
    after: dict[int, int],
    texts: dict[int, StackText],
    trigger: Trigger,
    took: float,
) -> StackCapture:
    captured_at = utcnow()
    behind, unreadable = _behind(target)
    ranks = []
    for rank in range(target.world):
        read = texts.get(rank)
        threads = stacks.parse_faulthandler(read.text) if read is not None and read.text else []
        if rank not in before:
            note: str | None = "its stacks file is not a regular file: not read"
        else:
            note = _note(after.get(rank, 0) - before.get(rank, 0), read, bool(threads))
        if rank in unreadable:
            note = "; ".join(filter(None, [note, UNREADABLE_DUMP]))
        host, at = hosts.get(rank), captured_at.timestamp()
        ranks.append(stacks.RankStacks(rank=rank, host=host, captured_at=at, threads=threads, note=note))
    groups = stacks.group_ranks(ranks)
    summary = stacks.summarize(groups, hosts)
    if behind:
        summary = f"{summary}; {behind}"
    return StackCapture(
        job_id=target.job_id,
        attempt=target.attempt,
        captured_at=captured_at,
        trigger=trigger,
        took_s=round(took, 3),
        summary=summary,
        ranks=[one.model_dump(exclude={"captured_at"}) for one in ranks],
        groups=[{**group.model_dump(), "label": stacks.format_ranks(group.ranks)} for group in groups],
    )


def _note(grew_by: int, read: StackText | None, parsed: bool) -> str | None:
    """What to tell about one rank's capture besides its stacks."""
    if grew_by <= 0 and (read is None or not read.text):
        return f"wrote no stacks within {WAIT_S:.0f} s (not started yet, ended, or not answering signals)"
    notes = []
    if read is not None and read.cut:
        size = f"{grew_by} bytes" if grew_by > 0 else "more"
        notes.append(f"wrote {size}; only its last {STACK_BYTES // 1024} KiB were read")
    if read is not None and read.restarted:
        notes.append("its stacks file was replaced: read from its start")
    if not parsed:
        notes.append("what it wrote holds no stack as Python's faulthandler writes one")
    return "; ".join(notes) or None


def _behind(target: _Target) -> tuple[str | None, set[int]]:
    """Which rank the NCCL flight recorder dumps say is behind (a GPU job's), or None; and the ranks
    whose dump could not be read (service.domain.flight_recorder refused it)."""
    dumps = read_flight_records(target.folder, target.world)
    records, unreadable = {}, set()
    for rank, data in dumps.items():
        record = stacks.parse_flight_recorder(data)
        if record is None:
            unreadable.add(rank)
        else:
            records[rank] = record
    return (stacks.behind_ranks(records) if len(records) > 1 else None), unreadable


def _store(engine: Engine, row: StackCapture, attempts: int = 2) -> None:
    """The attempt's last capture: the row replaced (another replica may insert it meanwhile)."""
    values = row.model_dump(exclude={"id"})
    for _ in range(attempts):
        try:
            with write_scope(engine) as session:
                query = select(StackCapture).where(
                    StackCapture.job_id == row.job_id, StackCapture.attempt == row.attempt
                )
                kept = session.exec(query).first()
                session.add(StackCapture(**values) if kept is None else _updated(kept, values))
            return
        except IntegrityError:
            continue


def _updated(kept: StackCapture, values: dict[str, Any]) -> StackCapture:
    for name, value in values.items():
        setattr(kept, name, value)
    return kept


def _public(row: StackCapture, fresh: bool) -> StackCapturePublic:
    return StackCapturePublic.model_validate(
        {
            "job_id": row.job_id,
            "attempt": row.attempt,
            "captured_at": row.captured_at,
            "trigger": row.trigger,
            "took_s": row.took_s,
            "summary": row.summary,
            "groups": row.groups,
            "ranks": row.ranks,
            "fresh": fresh,
        }
    )
