"""The audit log: who submitted, cancelled, created or revoked what, and when.

Entries are written in the transaction of the act itself, so the log never claims an act that was
rolled back, nor misses one that was committed.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from service.ledger.models.access import AuditEntry

MAX_PAGE = 500


def record(session: Session, actor: str, action: str, target: str, detail: str | None = None) -> None:
    session.add(AuditEntry(actor=actor, action=action, target=target, detail=detail))


def list_entries(
    session: Session, *, actor: str | None = None, before_id: int | None = None, limit: int = 100
) -> Sequence[AuditEntry]:
    """Newest first; `before_id` pages back through older entries."""
    query = select(AuditEntry)
    if actor is not None:
        query = query.where(AuditEntry.actor == actor)
    if before_id is not None:
        query = query.where(col(AuditEntry.id) < before_id)
    limit = max(1, min(limit, MAX_PAGE))
    return session.exec(query.order_by(col(AuditEntry.id).desc()).limit(limit)).all()
