"""The index behind `?name=`: which jobs' names hold a substring, found without reading every job.

What `name` matches, on every ledger: a substring of at least MIN_LENGTH characters, ASCII letters
compared case-insensitively and every other character exactly (what SQLite's LIKE does).

- SQLite: an FTS5 table with the trigram tokenizer over job.name (external content: it keeps only the
  index; triggers keep it in step with the job table). The names holding the substring's first and
  last trigram are the candidates (FTS5 folds case beyond ASCII too), a LIKE on them keeps the exact
  rule, and its rowid order is the job id order, so a page of a very common substring stops after
  its first rows.
- PostgreSQL: a pg_trgm GIN index on job.name under the "C" collation, the collation the ILIKE runs
  under (it folds ASCII only, whatever the database's locale).

On SQLite the index is kept in one piece (merge_segments, from every housekeeping pass): FTS5
adds a segment per write transaction and merges them only in fours, and a page walked backwards
through every segment of its trigrams: merged, every name page is read faster, a common
substring's most (docs/performance.md, Figures behind the design).

Migration 0010 built it from a frozen copy of the DDL below (a change to the index is a revision of
its own); bench.seed builds it again from this one. The models do not know it (SQLModel has no
virtual tables or operator classes), so a schema comparison leaves out what is_model_object names.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Column, Integer, MetaData, Table, Text, bindparam, literal_column
from sqlalchemy.engine import Engine
from sqlalchemy.sql.elements import ColumnElement
from sqlmodel import col

from service.ledger.db import writer_turn
from service.ledger.models.jobs import Job

MIN_LENGTH = 3  # a trigram index finds nothing shorter

FTS_TABLE = "job_name_index"
PG_INDEX = "ix_job_name_trgm"

SQLITE_CREATE: Sequence[str] = (
    f"CREATE VIRTUAL TABLE {FTS_TABLE} USING fts5(name, content='job', content_rowid='id', "
    "tokenize='trigram')",
    f"INSERT INTO {FTS_TABLE}({FTS_TABLE}) VALUES ('rebuild')",
    f"CREATE TRIGGER {FTS_TABLE}_insert AFTER INSERT ON job BEGIN "
    f"INSERT INTO {FTS_TABLE}(rowid, name) VALUES (new.id, new.name); END",
    f"CREATE TRIGGER {FTS_TABLE}_delete AFTER DELETE ON job BEGIN "
    f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, name) VALUES ('delete', old.id, old.name); END",
    f"CREATE TRIGGER {FTS_TABLE}_rename AFTER UPDATE OF name ON job BEGIN "
    f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rowid, name) VALUES ('delete', old.id, old.name); "
    f"INSERT INTO {FTS_TABLE}(rowid, name) VALUES (new.id, new.name); END",
)
SQLITE_DROP: Sequence[str] = (
    f"DROP TRIGGER IF EXISTS {FTS_TABLE}_rename",
    f"DROP TRIGGER IF EXISTS {FTS_TABLE}_delete",
    f"DROP TRIGGER IF EXISTS {FTS_TABLE}_insert",
    f"DROP TABLE IF EXISTS {FTS_TABLE}",
)
# pg_trgm is a trusted extension (PostgreSQL 13+): the database's owner may create it
POSTGRES_CREATE: Sequence[str] = (
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    f'CREATE INDEX IF NOT EXISTS {PG_INDEX} ON job USING gin (name COLLATE "C" gin_trgm_ops)',
)
POSTGRES_DROP: Sequence[str] = (f"DROP INDEX IF EXISTS {PG_INDEX}",)

# FTS5's incremental 'optimize': a negative page count merges every segment toward one, about that
# many pages a step. A step of 100 is a short write transaction, even on a ledger of 10^6 names.
MERGE_STEP_PAGES = 100
SQLITE_MERGE_STEP = f"INSERT INTO {FTS_TABLE}({FTS_TABLE}, rank) VALUES ('merge', -{MERGE_STEP_PAGES})"
MERGE_BUDGET_S = 60.0  # one call's merging; the next call goes on from where it stopped


def create_statements(dialect: str) -> Sequence[str]:
    return SQLITE_CREATE if dialect == "sqlite" else POSTGRES_CREATE


def drop_statements(dialect: str) -> Sequence[str]:
    return SQLITE_DROP if dialect == "sqlite" else POSTGRES_DROP


def is_model_object(name: str | None, type_: str, _parents: object) -> bool:
    """False for the objects this index owns (FTS5's table and its shadow tables, the GIN index):
    an Alembic `include_name` hook, so a comparison with the models leaves them out."""
    if name is None:
        return True
    if type_ == "table":
        return not (name == FTS_TABLE or name.startswith(f"{FTS_TABLE}_"))
    return not (type_ == "index" and name == PG_INDEX)


def merge_segments(
    engine: Engine, budget_s: float = MERGE_BUDGET_S, stop: threading.Event | None = None
) -> int:
    """SQLite: merge the index's segments into one, a step per write transaction, until nothing is
    left to merge, `budget_s` has passed or `stop` is set; the number of steps that merged something.
    PostgreSQL: nothing (its GIN index merges its pending entries itself).

    Each step takes this process's writer turn (db.writer_turn), as the loops' writes do, so they
    wait on that lock rather than in SQLite's busy handler. After each step it waits as long as the
    step took: the lock is not first come, first served, and a step begun at once after the last
    could take it again before a waiting writer.

    At most as many steps as rewriting the index as it stood at the start takes: every write adds a
    segment, and merging that into the one large segment rewrites the large one, so under steady
    writes the merge never runs out of work and would rewrite the whole index until the budget ends.
    """
    if engine.dialect.name != "sqlite":
        return 0
    steps = 0
    most = rewrite_steps(engine)
    deadline = time.monotonic() + budget_s
    stop = stop or threading.Event()
    while steps < most and time.monotonic() < deadline and not stop.is_set():
        started = time.monotonic()
        with writer_turn(engine), engine.begin() as connection:
            driver: Any = connection.connection.driver_connection  # sqlite3's Connection
            before = driver.total_changes
            connection.exec_driver_sql(SQLITE_MERGE_STEP)
            # FTS5's documented sign: a step that merged nothing changed fewer than two rows
            merged = driver.total_changes - before >= 2
        if not merged:
            break
        steps += 1
        stop.wait(time.monotonic() - started)
    return steps


def rewrite_steps(engine: Engine) -> int:
    """The steps one rewrite of the whole index takes: its pages (rows of FTS5's data table), a step's
    worth at a time, and one more for the step that finds nothing left (a generous count: a merge to
    one piece took fewer)."""
    with engine.connect() as connection:
        pages = int(connection.exec_driver_sql(f"SELECT count(*) FROM {FTS_TABLE}_data").scalar_one())
    return -(-pages // MERGE_STEP_PAGES) + 1


# FTS5's table as SQLAlchemy sees it: its rowid is the job id, its hidden column of its own name the
# left side of MATCH.
fts = Table(FTS_TABLE, MetaData(), Column("rowid", Integer, primary_key=True), Column(FTS_TABLE, Text))


def candidates(substring: str) -> str:
    """SQLite: the FTS5 query for the candidates, the names holding the substring's first trigram
    and its last one unlike the first (case aside), each an FTS5 string (its `"` doubled).

    Any trigrams of the substring find every name that holds it, and the LIKE keeps the exact rule,
    so FTS5 need not be given them all; it reads the list of names of every trigram it is given. A
    7-digit substring's five trigrams are each in thousands of names at 10^6 jobs: two of them read
    a page faster than the whole phrase, for a rare substring and for one half the names hold
    (bench.scale's name pages). The last trigram unlike the first: "0659065" asked for "065" alone,
    a longer list still, each of its names then tested. The price: a substring whose ends are
    common and whose middle is rare reads the ends' long lists, where the phrase would have been led
    by its rare trigram; such a page passes the reader's budget on the event loop and is read in a
    thread (service.api.reader).
    PostgreSQL's trigram index gained nothing from the same (its false candidates are heap reads).
    """
    trigrams = [substring[start : start + 3] for start in range(len(substring) - 2)]
    first = trigrams[0]
    last = next((t for t in reversed(trigrams) if t.lower() != first.lower()), None)
    return " AND ".join('"' + trigram.replace('"', '""') + '"' for trigram in (first, last) if trigram)


def like_pattern(substring: str) -> str:
    """LIKE pattern matching `substring` anywhere, its own % and _ taken literally (escape '/')."""
    escaped = substring.replace("/", "//").replace("%", "/%").replace("_", "/_")
    return f"%{escaped}%"


def sqlite_match() -> ColumnElement[bool]:
    return fts.c[FTS_TABLE].match(bindparam("candidates"))


def name_like(dialect: str, *, by_index: bool = True) -> ColumnElement[bool]:
    """The exact rule, on the job row: SQLite's LIKE folds ASCII only; ILIKE under "C" does the same.
    `by_index=False` (PostgreSQL): the same rule on `name || ''`, an expression no index holds, so
    that the planner tests the rows it walks instead of reading the trigram index."""
    name = col(Job.name)
    if dialect == "sqlite":
        return name.like(bindparam("name"), escape="/")
    tested = name if by_index else name.concat(literal_column("''")).self_group()
    return tested.collate("C").ilike(bindparam("name"), escape="/")
