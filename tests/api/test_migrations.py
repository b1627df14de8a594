"""Alembic migrations: they build the whole ledger on an empty SQLite and PostgreSQL database, running
them again changes nothing, and the result matches the models exactly (no drift)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect
from sqlalchemy.engine import Engine
from sqlmodel import SQLModel

from service.ledger.db import alembic_config, make_engine, migrate
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
        differences = compare_metadata(MigrationContext.configure(connection), SQLModel.metadata)

    assert differences == []
