"""Statements about many jobs at once: match a set of ids in as few parameters as possible."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import SQLColumnExpression
from sqlalchemy.sql.elements import ColumnElement

CHUNK = 900  # ids per UPDATE ... IN (...): well under every database's parameter limit


def id_chunks(ids: Sequence[int]) -> Iterable[Sequence[int]]:
    """Ids in slices for `... IN (...)`, each well under every database's parameter limit."""
    for start in range(0, len(ids), CHUNK):
        yield ids[start : start + CHUNK]


def id_conditions(column: SQLColumnExpression[Any], ids: Iterable[int]) -> Iterable[ColumnElement[bool]]:
    """WHERE conditions, one statement each, that together match exactly these ids.

    Jobs posted or claimed together mostly have consecutive ids, and then one `BETWEEN` of two
    parameters is exact (every id in the range is one of them). An `IN` list costs SQLAlchemy a pass
    per value at every execution (its expanding parameters): a large part of the intake's time under load.
    Ids with gaps go out as `IN` lists, in chunks.
    """
    ordered = sorted(set(ids))
    if not ordered:
        return
    if ordered[-1] - ordered[0] == len(ordered) - 1:
        yield column.between(ordered[0], ordered[-1])
        return
    for chunk in id_chunks(ordered):
        yield column.in_(chunk)
