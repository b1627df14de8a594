"""The dispatcher's fair share: which queued jobs a tick claims, and in what order it prepares them.

Owners take turns (each owner's oldest job, then each one's second, ...), so one user's hundreds of
queued jobs never hold another user's job back for more than one place a round."""

from __future__ import annotations

from collections import Counter

from sqlalchemy import ColumnElement, Select, func
from sqlalchemy import select as core_select
from sqlalchemy.engine import RowMapping
from sqlmodel import col

from service.ledger.models.jobs import Job


def owners_in_turn(candidates: ColumnElement[bool], most: int) -> Select[tuple[int]]:
    """The ids of up to `most` of the candidates, owners in turn: each owner's oldest first, then each
    one's second, and so on. One user's hundreds of queued jobs take one place a round in a batch,
    so another user's job goes in this tick, not after them. (A subquery: PostgreSQL allows no
    FOR UPDATE beside a window function.)"""
    turn = func.row_number().over(partition_by=col(Job.owner), order_by=col(Job.id)).label("turn")
    ranked = core_select(col(Job.id), turn).where(candidates).subquery()
    return core_select(ranked.c.id).order_by(ranked.c.turn, ranked.c.id).limit(most)


def in_owners_turn(rows: list[RowMapping]) -> list[RowMapping]:
    """The claimed rows in the order their folders are made and handed over: owners in turn, as
    claimed."""
    seen: Counter[str | None] = Counter()
    turns = []
    for row in rows:  # by id: each owner's oldest first
        seen[row["owner"]] += 1
        turns.append((seen[row["owner"]], row["id"], row))
    return [row for _, _, row in sorted(turns, key=lambda turn: turn[:2])]
