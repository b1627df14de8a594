"""id_conditions: WHERE conditions that match exactly a set of job ids, in as few parameters as it can."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from service.ledger.sql import CHUNK, id_conditions


@pytest.fixture
def table() -> tuple[sa.engine.Connection, sa.Table]:
    engine = sa.create_engine("sqlite://")
    rows = sa.Table("rows", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    rows.metadata.create_all(engine)
    connection = engine.connect()
    connection.execute(sa.insert(rows), [{"id": n} for n in range(1, 3001)])
    return connection, rows


def matched(table: tuple[sa.engine.Connection, sa.Table], ids: list[int]) -> tuple[list[int], list[str]]:
    """The ids the conditions select, and each condition's SQL."""
    connection, rows = table
    found: list[int] = []
    sql: list[str] = []
    for condition in id_conditions(rows.c.id, ids):
        sql.append(str(condition.compile(compile_kwargs={"literal_binds": True})))
        found.extend(connection.execute(sa.select(rows.c.id).where(condition)).scalars())
    return sorted(found), sql


def test_consecutive_ids_are_one_range_of_two_parameters(
    table: tuple[sa.engine.Connection, sa.Table],
) -> None:
    found, sql = matched(table, [14, 12, 13, 11, 12])

    assert found == [11, 12, 13, 14]
    assert sql == ["rows.id BETWEEN 11 AND 14"]


def test_ids_with_a_gap_are_in_lists_and_never_match_the_gap(
    table: tuple[sa.engine.Connection, sa.Table],
) -> None:
    found, sql = matched(table, [5, 6, 8])

    assert found == [5, 6, 8]  # 7 lies between them but is not one of them
    assert sql == ["rows.id IN (5, 6, 8)"]


def test_long_scattered_lists_are_chunked_and_no_ids_mean_no_statement(
    table: tuple[sa.engine.Connection, sa.Table],
) -> None:
    scattered = list(range(1, 3001, 3))  # 1000 ids, none next to another

    found, sql = matched(table, scattered)

    assert found == scattered
    assert len(sql) == -(-len(scattered) // CHUNK) == 2 and all(" IN (" in one for one in sql)
    assert matched(table, []) == ([], [])
