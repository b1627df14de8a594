"""The dispatcher's fair share: the order in which a tick claims queued jobs.

Owners take turns (each owner's oldest job, then each one's second, ...), so one user's hundreds of
queued jobs never hold another user's job back for more than one place a round."""

from __future__ import annotations

from sqlalchemy import ColumnElement, Subquery, func
from sqlalchemy import select as core_select
from sqlmodel import col

from service.ledger.models.jobs import Job


def turns(candidates: ColumnElement[bool]) -> Subquery:
    """Each candidate's `id` and its `turn`: 1 for each owner's oldest, 2 for each one's second, ...
    A claim joins it and orders by (turn, id). It is a subquery so that the claim can lock the job
    rows alone (FOR UPDATE OF job: PostgreSQL locks no rows of a window function's query), and
    skip those another replica holds as it goes, the LIMIT counting only the rows it took."""
    turn = func.row_number().over(partition_by=col(Job.owner), order_by=col(Job.id)).label("turn")
    return core_select(col(Job.id), turn).where(candidates).subquery("turns")
