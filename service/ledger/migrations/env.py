"""Alembic environment: runs against the engine the service hands over (no URL in an ini file)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import text
from sqlmodel import SQLModel

import service.ledger.models  # noqa: F401  (registers the tables on SQLModel.metadata)
from service.ledger.name_index import is_model_object

target_metadata = SQLModel.metadata


def run_migrations_online() -> None:
    engine = context.config.attributes["engine"]
    with engine.connect() as connection:
        if connection.dialect.name == "postgresql":
            # Two replicas starting together must not both create the tables.
            connection.execute(text("SELECT pg_advisory_xact_lock(727274)"))
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            include_name=is_model_object,  # the name index is built by hand (0010), not from the models
        )
        with context.begin_transaction():
            context.run_migrations()
        connection.commit()


run_migrations_online()
