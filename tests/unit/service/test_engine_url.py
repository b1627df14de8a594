"""make_engine keeps a bare postgresql:// URL on psycopg2, the driver the postgres extra installs and
the reader's asynchronous reads use (SQLAlchemy 2.1 picks psycopg 3 for it)."""

from __future__ import annotations

from service.ledger.db import make_engine


def test_a_bare_postgresql_url_is_read_through_psycopg2() -> None:
    engine = make_engine("postgresql://torchyard:s3cret@db.invalid:5433/ledger")  # never connects
    try:
        assert engine.dialect.driver == "psycopg2"
        url = engine.url
        assert (url.username, url.password, url.host, url.port, url.database) == (
            "torchyard", "s3cret", "db.invalid", 5433, "ledger"
        )
    finally:
        engine.dispose()


def test_a_url_that_names_its_driver_keeps_it() -> None:
    engine = make_engine("postgresql+psycopg2://torchyard@db.invalid/ledger")
    try:
        assert engine.dialect.driver == "psycopg2"
    finally:
        engine.dispose()
