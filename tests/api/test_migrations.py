"""Alembic migrations: they build the whole ledger on an empty SQLite and PostgreSQL database, running
them again changes nothing, and the result matches the models exactly (no drift)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlmodel import Session, SQLModel

from service.domain.auth import Principal
from service.domain.jobs import PageQuery, page_index
from service.domain.metric_series import SeriesKey, read_series, refresh
from service.ledger.db import alembic_config, make_engine, migrate
from service.ledger.models.columns import utcnow
from service.ledger.name_index import FTS_TABLE, PG_INDEX, is_model_object
from tests.support import PostgresServer


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An engine on a database with no tables at all (not even Alembic's)."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'empty.db'}"
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        url = server.new_database()
    engine = make_engine(url)
    yield engine
    engine.dispose()


def current_revision(engine: Engine) -> str | None:
    with engine.connect() as connection:
        return MigrationContext.configure(connection).get_current_revision()


def test_migrations_build_the_ledger_and_are_idempotent(empty_engine: Engine) -> None:
    head = ScriptDirectory.from_config(alembic_config(empty_engine)).get_current_head()
    assert inspect(empty_engine).get_table_names() == []

    migrate(empty_engine)
    tables = set(inspect(empty_engine).get_table_names())
    migrate(empty_engine)  # a second start, or a second replica

    assert current_revision(empty_engine) == head
    assert {"job", "jobevent", "jobmetric", "alembic_version"} <= tables
    assert set(inspect(empty_engine).get_table_names()) == tables


def test_the_migrated_schema_matches_the_models(empty_engine: Engine) -> None:
    migrate(empty_engine)

    with empty_engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"include_name": is_model_object})
        differences = compare_metadata(context, SQLModel.metadata)

    assert differences == []


def test_metrics_older_than_the_rollup_are_downsampled_after_the_migration(empty_engine: Engine) -> None:
    command.upgrade(alembic_config(empty_engine), "0005")
    with empty_engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO job (id, name, owner, spec, backend, state, attempt, progress_offset, "
            "cancel_requested, created_at, updated_at) VALUES (1, 'old', 'alice', '{}', 'local', "
            "'succeeded', 1, 0, false, :now, :now)"), {"now": utcnow()})  # fmt: skip
        rows = [{"step": s, "value": float(s % 97), "now": utcnow()} for s in range(5000)]
        connection.execute(text(
            "INSERT INTO jobmetric (job_id, step, name, value, attempt, time) "
            "VALUES (1, :step, 'loss', :value, 1, :now)"), rows)  # fmt: skip

    migrate(empty_engine)

    with Session(empty_engine) as session:
        page = read_series(session, 1, Principal(user="alice", admin=False), points=400)
    (series,) = page.series
    assert series.downsampled and 0 < len(series.steps) <= 400
    assert (series.steps[0], series.steps[-1]) == (0, 4999) and max(series.values) == 96.0


def test_0008_builds_the_buckets_the_live_rollup_builds(empty_engine: Engine) -> None:
    """The migration keeps a frozen copy of the rollup: today it must agree with the live one, point
    for point (repeated steps, ties, several series, steps reaching the upper levels)."""
    command.upgrade(alembic_config(empty_engine), "0007")
    series: list[tuple[str, int, list[int]]] = [
        ("loss", 1, list(range(0, 3000))),
        ("loss", 2, [*range(2500, 2600), *range(2550, 2560)]),  # a resumed attempt repeats steps
        ("lr", 1, list(range(0, 300_000, 997))),
    ]
    rows = [
        {"step": step, "name": name, "attempt": attempt, "value": float((step * 7919 + attempt) % 89) - 40}
        for name, attempt, steps in series
        for step in steps
    ]
    now = utcnow()
    with empty_engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO job (id, name, owner, spec, backend, state, attempt, progress_offset, "
            "cancel_requested, created_at, updated_at) VALUES (1, 'old', 'alice', '{}', 'local', "
            "'succeeded', 2, 0, false, :now, :now)"), {"now": now})  # fmt: skip
        connection.execute(text(
            "INSERT INTO jobmetric (job_id, step, name, value, attempt, time) "
            "VALUES (1, :step, :name, :value, :attempt, :now)"),
            [{**row, "now": now} for row in rows])  # fmt: skip

    migrate(empty_engine)
    migrated = rollup_rows(empty_engine)
    with empty_engine.begin() as connection:
        connection.execute(text("DELETE FROM jobmetricrollup"))
        for name, attempt, steps in series:
            refresh(connection, SeriesKey(1, name, attempt), min(steps), max(steps))
    live = rollup_rows(empty_engine)

    assert {row[1] for row in live} == set(range(1, 8))  # every level has buckets
    assert migrated == live


def rollup_rows(engine: Engine) -> list[tuple[object, ...]]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(
            "SELECT job_id, level, name, attempt, bucket, count, first_step, first_value, last_step, "
            "last_value, min_step, min_value, max_step, max_value FROM jobmetricrollup "
            "ORDER BY job_id, level, name, attempt, bucket"))]  # fmt: skip


def test_0010_builds_the_name_index_over_the_jobs_there_and_takes_it_away(empty_engine: Engine) -> None:
    migrate(empty_engine)
    add_job(empty_engine, 1, "before-the-index")
    add_job(empty_engine, 2, "other")
    config = alembic_config(empty_engine)

    command.downgrade(config, "0009")
    assert not has_name_index(empty_engine)
    add_job(empty_engine, 3, "written-without-INDEX")  # the upgrade must index it too
    command.upgrade(config, "head")

    assert has_name_index(empty_engine)
    add_job(empty_engine, 4, "after-the-index")
    with empty_engine.connect() as connection:
        page = page_index(connection, PageQuery(name="index"))
    assert [job_id for job_id, _ in page.entries] == [4, 3, 1]


def add_job(engine: Engine, job_id: int, name: str) -> None:
    with engine.begin() as connection:
        connection.execute(text(
            "INSERT INTO job (id, name, owner, spec, backend, state, attempt, progress_offset, "
            "cancel_requested, created_at, updated_at) VALUES (:id, :name, 'alice', '{}', 'local', "
            "'succeeded', 1, 0, false, :now, :now)"), {"id": job_id, "name": name, "now": utcnow()},
        )  # fmt: skip


def has_name_index(engine: Engine) -> bool:
    found = inspect(engine)
    if engine.dialect.name == "sqlite":
        return FTS_TABLE in found.get_table_names()
    return PG_INDEX in {index["name"] for index in found.get_indexes("job")}
