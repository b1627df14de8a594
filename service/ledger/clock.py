"""The ledger clock: one counter row, bumped at commit by every transaction that changes a job.

Polling readers need two things from the ledger: an ETag that changes whenever anything they might
see changes, cheap enough to compute on every poll, and a `since` watermark that never misses a
change. A timestamp taken in Python when a row is modified gives neither: transaction A can stamp a
job at T1 and commit after transaction B stamped T2 > T1; a reader in between has moved past T1 and
never sees A's change.

So the stamp is taken at commit time, after the clock row is locked (an UPDATE takes its row lock on
PostgreSQL; SQLite has one writer at a time anyway), and every job the transaction touched gets that
stamp as `updated_at`. Commits are then ordered by their stamps: a reader that saw the clock at
(seq, stamped_at) before reading jobs knows that every later change has a larger seq and an
`updated_at` strictly after stamped_at. The clock is the last row a transaction locks and is held
only until COMMIT, so it adds no lock cycle (no deadlock with FOR UPDATE on job rows).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from sqlalchemy import Table, bindparam, event, insert, select, update
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.orm.attributes import set_committed_value
from sqlmodel import col

from service.ledger.models.columns import utcnow
from service.ledger.models.history import JobEvent, LedgerClock
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric
from service.ledger.sql import id_conditions

log = logging.getLogger(__name__)

_CHANGED = "torchyard.changed_job_ids"
_STAMPED = "torchyard.stamped_job_ids"  # what this transaction stamped, told to listeners after COMMIT
_TICK = timedelta(microseconds=1)
_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class LedgerVersion:
    """What a reader saw of the clock: `seq` names the ledger's state, `stamped_at` its last commit."""

    seq: int
    stamped_at: datetime


def read_version(session: Session) -> LedgerVersion:
    """The clock as last committed. Read it BEFORE the data it describes (see the module docstring)."""
    return read_version_on(session.connection())


_CLOCK: Table = LedgerClock.__table__  # type: ignore[attr-defined]
CLOCK_ROW = select(col(LedgerClock.seq), col(LedgerClock.stamped_at)).where(col(LedgerClock.id) == 1)


def read_version_on(connection: Connection) -> LedgerVersion:
    """read_version on a bare connection (a poll's own clock read is service.api.reader's)."""
    return version_of(connection.execute(CLOCK_ROW).first())


def version_of(row: Sequence[Any] | None) -> LedgerVersion:
    """The version a CLOCK_ROW row names (service.api.reader runs CLOCK_ROW itself)."""
    if row is None:  # a ledger made by create_all that nothing has written to yet
        return LedgerVersion(0, _EPOCH)
    return LedgerVersion(int(row[0]), row[1])


CommitListener = Callable[[Collection[int]], None]
_listeners: weakref.WeakKeyDictionary[Engine, list[CommitListener]] = weakref.WeakKeyDictionary()


def on_stamped_commit(engine: Engine, listener: CommitListener) -> None:
    """Call listener(job ids) after every commit on this engine that stamped jobs (long polls wait on
    it). It runs on the committing thread, after COMMIT: it must be quick and must not raise."""
    _listeners.setdefault(engine, []).append(listener)


def install() -> None:
    """Register the session hooks (idempotent). Called by service.ledger.db.make_engine."""
    for name, hook in (
        ("after_flush", _after_flush),
        ("before_commit", _before_commit),
        ("after_commit", _after_commit),
        ("after_transaction_end", _after_transaction_end),
    ):
        if not event.contains(Session, name, hook):
            event.listen(Session, name, hook)


# ---------------------------------------------------------------- hooks


def _after_flush(session: Session, _flush_context: Any) -> None:
    # Here session.new / dirty still show what this flush wrote, and new rows have their ids.
    changed: set[int] = session.info.setdefault(_CHANGED, set())
    for obj in session.new:
        _collect(changed, obj)
    for obj in session.dirty:
        if session.is_modified(obj, include_collections=False):
            _collect(changed, obj)
    for obj in session.deleted:
        _collect(changed, obj)


def _collect(changed: set[int], obj: object) -> None:
    if isinstance(obj, Job) and obj.id is not None:
        changed.add(obj.id)
    elif isinstance(obj, JobEvent | JobMetric):
        changed.add(obj.job_id)


def _before_commit(session: Session) -> None:
    if session.in_nested_transaction():
        return  # the outermost commit stamps everything at once
    session.flush()  # whatever is still pending is collected now, not after the stamp
    changed: set[int] = session.info.pop(_CHANGED, set())
    if not changed:
        return
    stamp = stamp_jobs(session, changed)
    # Keep the objects the caller holds (expire_on_commit=False) equal to what was written.
    for obj in session.identity_map.values():
        if isinstance(obj, Job) and obj.id in changed:
            set_committed_value(obj, "updated_at", stamp)


def note_changed(session: Session, job_ids: Iterable[int]) -> None:
    """Jobs this transaction changed through Core: stamped at commit with what the ORM changed."""
    session.info.setdefault(_CHANGED, set()).update(job_ids)


def stamp_jobs(session: Session, job_ids: Iterable[int]) -> datetime:
    """Bump the clock and stamp these jobs' `updated_at` with it; returns the stamp.

    The hooks do this for ORM writes. A writer that changes jobs through Core (the group-commit
    intake) calls it itself, as the last statement before COMMIT, for the same ordering reason."""
    ids = sorted(job_ids)
    stamp = _tick(session)
    session.info.setdefault(_STAMPED, set()).update(ids)
    for condition in id_conditions(col(Job.id), ids):
        session.execute(
            update(Job).where(condition).values(updated_at=stamp),
            execution_options={"synchronize_session": False},
        )
    return stamp


def _after_commit(session: Session) -> None:
    stamped: set[int] | None = session.info.pop(_STAMPED, None)
    if not stamped:
        return
    bind = session.get_bind()
    engine = bind.engine if isinstance(bind, Connection) else bind
    for listener in _listeners.get(engine, ()):
        try:
            listener(stamped)
        except Exception:  # the commit has happened: a listener's failure must not look like its failure
            log.exception("a commit listener failed")


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.parent is None:  # rolled back or closed: what was collected is void
        session.info.pop(_CHANGED, None)
        session.info.pop(_STAMPED, None)


def _tick(session: Session) -> datetime:
    """Bump the clock (taking its lock) and return a stamp strictly after the last committed one.

    Core statements on the session's connection: through the ORM, the RETURNING row went through
    its object loading, which under a burst of POSTs dominated the intake's time. Built once (_BUMP,
    _SET_STAMP): every write transaction ticks, and building them was much of a stamp's CPU."""
    connection = session.connection()
    bumped = connection.execute(_BUMP).first()
    now = utcnow()
    if bumped is None:
        connection.execute(insert(_CLOCK).values(id=1, seq=1, stamped_at=now))
        return now
    stamp: datetime = max(now, bumped[0] + _TICK)  # monotonic even if the wall clock steps back
    connection.execute(_SET_STAMP, {"stamp": stamp})
    return stamp


_BUMP = update(_CLOCK).where(_CLOCK.c.id == 1).values(seq=_CLOCK.c.seq + 1).returning(_CLOCK.c.stamped_at)
_SET_STAMP = update(_CLOCK).where(_CLOCK.c.id == 1).values(stamped_at=bindparam("stamp"))
