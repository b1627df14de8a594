"""A migrated ledger engine on each database the suite runs (SQLite, PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine

from service.config import Settings
from service.ledger.db import make_engine, migrate


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    made = make_engine(settings.database_url)
    migrate(made)
    yield made
    made.dispose()
