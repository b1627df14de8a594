"""`?name=` through the name index (service.ledger.name_index) on SQLite and PostgreSQL: the pages it
answers are those a plain scan answers, the index follows every insert, rename and delete, and on
SQLite the index leads in id order (no sort of every match)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import delete, insert, select, text, update
from sqlalchemy.engine import Connection, Engine
from sqlmodel import col

from service.domain import jobs
from service.domain.cursors import encode_cursor
from service.domain.jobs import PageQuery, _page_statement, page_index
from service.ledger import name_index
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.states import JobState

# LIKE's wildcards and our escape, quotes, case pairs in and out of ASCII, letters that fold to ASCII
# elsewhere (Kelvin sign, dotless i, ligature fi), CJK
PIECES = ["train", "Train", "BERT", "bert", "%", "_", "/", "//", "%_", '"', "'", " ", "-", "\u00e9", "\u00c9",
          "\u00df", "SS", "\u65e5\u672c", "\u8a9e", "\ufb01", "\u0130", "\u0131", "k", "K", "\u212a", "0",
          "42", "x", "a\\b", "\u00fcmlaut", "\u00dc"]  # fmt: skip
STATES = (JobState.succeeded, JobState.running, JobState.failed)
OWNERS = ("alice", "bob")


def ascii_fold(text: str) -> str:
    """The rule `name` follows: A-Z as a-z, every other character as it is."""
    return text.translate({c: c + 32 for c in range(ord("A"), ord("Z") + 1)})


def add_jobs(connection: Connection, names: list[str], first_id: int = 1) -> None:
    now = utcnow()
    rows: list[dict[str, Any]] = [
        {"id": first_id + i, "name": name, "owner": OWNERS[i % 2], "backend": "local",
         "state": STATES[i % 3].value, "spec": {}, "attempt": 1, "progress_offset": 0,
         "cancel_requested": False, "created_at": now, "updated_at": now + timedelta(seconds=i % 5)}
        for i, name in enumerate(names)
    ]  # fmt: skip
    connection.execute(insert(Job), rows)


def varied_names(count: int, rng: random.Random) -> list[str]:
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 6))) for _ in range(count)]


def walk(connection: Connection, query: PageQuery) -> list[int]:
    """Every id the list answers for `query`, page after page."""
    found: list[int] = []
    while True:
        page = page_index(connection, query)
        found += [job_id for job_id, _ in page.entries if job_id is not None]
        if page.next_cursor is None:
            return found
        query = PageQuery(
            query.state, query.name, query.owner, page.next_cursor, query.limit, query.updated_since
        )


def scanned(connection: Connection, query: PageQuery) -> list[int]:
    """The same filters by reading every job, the name compared by ascii_fold."""
    columns = (col(Job.id), col(Job.name), col(Job.owner), col(Job.state), col(Job.updated_at))
    rows: Sequence[Any] = connection.execute(select(*columns).order_by(col(Job.id).desc())).all()
    since = query.updated_since
    return [
        job_id
        for job_id, name, owner, state, updated_at in rows
        if query.name is not None
        and ascii_fold(query.name) in ascii_fold(name)
        and query.owner in (None, owner)
        and (not query.state or state in {s.value for s in query.state})
        and (since is None or updated_at >= since)
    ]


def substrings(names: list[str], rng: random.Random, count: int) -> Iterator[str]:
    """Substrings that occur (some with their case flipped) and some that may not."""
    for _ in range(count):
        name = rng.choice(names)
        if len(name) >= name_index.MIN_LENGTH and rng.random() < 0.7:
            start = rng.randrange(len(name) - name_index.MIN_LENGTH + 1)
            piece = name[start : start + rng.randint(name_index.MIN_LENGTH, 8)]
            yield piece.swapcase() if rng.random() < 0.3 else piece
        else:
            yield "".join(rng.choice(PIECES) for _ in range(3))[:8].ljust(3, "x")


# (13, 97): PostgreSQL's pages in all their parts (_postgres_name_rows)
@pytest.mark.parametrize("near_ids, recent_ids", [(jobs.NEAR_IDS, jobs.RECENT_IDS), (13, 97)])
def test_indexed_names_answer_what_a_plain_scan_answers(
    engine: Engine, near_ids: int, recent_ids: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(jobs, "NEAR_IDS", near_ids)
    monkeypatch.setattr(jobs, "RECENT_IDS", recent_ids)
    rng = random.Random(19)
    names = varied_names(3000, rng)
    with engine.begin() as connection:
        add_jobs(connection, names)
    since = utcnow() + timedelta(seconds=3)
    with engine.connect() as connection:
        for n, substring in enumerate(substrings(names, rng, 120)):
            query = PageQuery(
                state=(STATES[n % 3],) if n % 4 == 1 else (),
                name=substring,
                owner=OWNERS[n % 2] if n % 3 == 0 else None,
                limit=rng.choice([1, 7, 50, 500]),
                updated_since=since if n % 5 == 2 else None,
            )
            assert walk(connection, query) == scanned(connection, query), query


def test_on_sqlite_the_list_matches_like_as_it_did_before_the_index(engine: Engine) -> None:
    if engine.dialect.name != "sqlite":
        pytest.skip("SQLite's LIKE is the rule the index keeps")
    rng = random.Random(7)
    names = varied_names(2000, rng)
    with engine.begin() as connection:
        add_jobs(connection, names)
    with engine.connect() as connection:
        for substring in substrings(names, rng, 60):
            pattern = name_index.like_pattern(substring)
            plain = connection.execute(
                text("SELECT id FROM job WHERE name LIKE :p ESCAPE '/' ORDER BY id DESC"), {"p": pattern}
            ).scalars()
            assert walk(connection, PageQuery(name=substring, limit=500)) == list(plain), substring


def test_a_name_holding_the_substrings_ends_but_not_the_substring_is_left_out(engine: Engine) -> None:
    # On SQLite FTS5 is asked for the first and last trigram only (name_index.candidates)
    names = ["abc-def", "def-abc", "abcXdef", "xABCdefx", "abc", "abcdef", 'a"bcd"ef', 'bcd"ef']
    with engine.begin() as connection:
        add_jobs(connection, names)
    with engine.connect() as connection:
        assert walk(connection, PageQuery(name="abcdef")) == [6, 4]
        assert walk(connection, PageQuery(name='bcd"e')) == [8, 7]
        assert walk(connection, PageQuery(name="abc")) == [6, 5, 4, 3, 2, 1]
    assert name_index.candidates('a"bcde') == '"a""b" AND "cde"'
    assert name_index.candidates("abc") == '"abc"'
    assert name_index.candidates("0659065") == '"065" AND "906"'  # not "065" alone
    assert name_index.candidates("abcABC") == '"abc" AND "cAB"'  # not ABC: FTS5 folds case


def test_the_index_follows_inserts_renames_and_deletes(engine: Engine) -> None:
    with engine.begin() as connection:
        add_jobs(connection, ["alpha-one", "beta-two", "alpha-three"])
    with engine.begin() as connection:
        connection.execute(update(Job).where(Job.id == 2).values(name="alpha-renamed"))  # type: ignore[arg-type]
        connection.execute(update(Job).where(Job.id == 3).values(name="gamma"))  # type: ignore[arg-type]
        connection.execute(delete(Job).where(Job.id == 1))  # type: ignore[arg-type]
        add_jobs(connection, ["alpha-four"], first_id=4)

    with engine.connect() as connection:
        assert walk(connection, PageQuery(name="ALPHA")) == [4, 2]
        assert walk(connection, PageQuery(name="beta")) == []
        assert walk(connection, PageQuery(name="gam")) == [3]
        if engine.dialect.name == "sqlite":  # FTS5 compares its index with the job table itself
            table = name_index.FTS_TABLE
            connection.execute(text(f"INSERT INTO {table}({table}, rank) VALUES ('integrity-check', 1)"))


def test_on_sqlite_a_name_page_walks_the_index_in_id_order_without_a_sort(engine: Engine) -> None:
    if engine.dialect.name != "sqlite":
        pytest.skip("on PostgreSQL the plan follows its statistics: bench.scale measures 10^6 jobs")
    for shape in [(False, True, False, False, False), (True, True, True, True, True)]:
        compiled = _page_statement("sqlite", shape).compile(engine)
        with engine.connect() as connection:
            values = {"state0": "running", "name": "%abc%", "candidates": '"abc"', "owner": "alice",
                      "since": utcnow(), "before": 10, "limit": 51}  # fmt: skip
            expanded = compiled.construct_expanded_state(values)
            positional = tuple(expanded.parameters[key] for key in expanded.positiontup or ())
            plan = " | ".join(
                row[-1]
                for row in connection.exec_driver_sql("EXPLAIN QUERY PLAN " + expanded.statement, positional)
            )
        assert plan.startswith(f"SCAN {name_index.FTS_TABLE} VIRTUAL TABLE"), plan
        assert "TEMP B-TREE" not in plan and "SEARCH job USING INTEGER PRIMARY KEY" in plan, plan


NAME_PAGE_PARTS = ("near", "recent", "older")


def postgres_name_parts(
    query: PageQuery, found: list[list[int]]
) -> tuple[list[tuple[str, int, int]], list[int]]:
    """The parts a PostgreSQL name page (a name alone) read after the newest id (10^6), as (part,
    before, floor), when each found the ids in `found`; and the page's ids."""
    statements = {_page_statement("postgresql", (0, True, False, False, True), p): p for p in NAME_PAGE_PARTS}
    reads = jobs.page_reads("postgresql", query)
    statement, _ = next(reads)
    assert str(statement) == str(jobs._NEWEST)
    parts = []
    try:
        statement, values = reads.send([(10**6,)])
        for ids in found:
            parts.append((statements[statement], values["before"], values.get("floor", 0)))
            statement, values = reads.send([(job_id, utcnow()) for job_id in ids])
    except StopIteration as done:
        return parts, [job_id for job_id, _ in done.value.entries]
    raise AssertionError(f"more reads than expected: {parts}")


def test_on_postgresql_a_cursor_beyond_the_newest_job_still_reads_the_near_ids_first() -> None:
    """A cursor past the newest id (jobs deleted since, or a bench's uncached walk) must not leave
    the windows empty: every such page then sorted all the older matches (0.5 s at 10^6)."""
    query = PageQuery(name="abc", cursor=encode_cursor(10**9), limit=2)
    parts, page = postgres_name_parts(query, [[999_999, 999_998, 999_990]])  # the near ids filled the page
    assert parts == [("near", 10**6 + 1, 10**6 + 1 - jobs.NEAR_IDS)]
    assert page == [999_999, 999_998]


def test_on_postgresql_a_rare_name_goes_from_the_near_ids_to_the_index() -> None:
    """No match among the near ids: the trigram index next, once (the planner's pick for the
    recent ids read it too)."""
    parts, page = postgres_name_parts(PageQuery(name="abc", limit=5), [[], [17]])
    top = 10**6 + 1
    assert parts == [("near", top, top - jobs.NEAR_IDS), ("older", top - jobs.NEAR_IDS, 0)]
    assert page == [17]


def test_under_steady_writes_a_merge_rewrites_the_index_once_and_stops(engine: Engine) -> None:
    """Each write adds a segment that merging folds into the large one by rewriting it: a merge that
    went on while there was something to merge ran for its whole budget, every housekeeping pass."""
    if engine.dialect.name != "sqlite":
        return
    names = varied_names(3000, random.Random(5))
    for first in range(0, len(names), 100):
        with engine.begin() as connection:
            add_jobs(connection, names[first : first + 100], first_id=first + 1)
    assert name_index.merge_segments(engine) > 0  # one piece, as housekeeping leaves it
    most = name_index.rewrite_steps(engine)  # for the index as it stands before the writer starts
    writing = threading.Event()
    writing.set()

    def write() -> None:  # a job a transaction, as the intake writes under a steady trickle
        next_id = len(names) + 1
        while writing.is_set():
            with engine.begin() as connection:
                add_jobs(connection, [f"late-{next_id}"], first_id=next_id)
            next_id += 1

    writer = threading.Thread(target=write)
    writer.start()
    try:
        time.sleep(0.2)  # segments to merge before the merge starts
        started = time.monotonic()
        steps = name_index.merge_segments(engine, budget_s=20.0)
        took = time.monotonic() - started
    finally:
        writing.clear()
        writer.join()
    assert 0 < steps <= most, (steps, most)
    assert took < 10.0, took  # the budget is not what ends it


def test_on_postgresql_a_name_the_near_ids_hold_reads_the_recent_ids_before_the_index() -> None:
    top = 10**6 + 1
    near, recent = top - 5, top - jobs.NEAR_IDS - 1
    parts, page = postgres_name_parts(PageQuery(name="abc", limit=5), [[near], [recent], [3, 2]])
    assert parts == [
        ("near", top, top - jobs.NEAR_IDS),
        ("recent", top - jobs.NEAR_IDS, top - jobs.RECENT_IDS),
        ("older", top - jobs.RECENT_IDS, 0),
    ]
    assert page == [near, recent, 3, 2]


def test_on_sqlite_housekeeping_merges_the_index_into_one_piece(engine: Engine) -> None:
    if engine.dialect.name != "sqlite":
        assert name_index.merge_segments(engine) == 0  # PostgreSQL's GIN index merges itself
        return
    rng = random.Random(3)
    names = varied_names(600, rng)
    for first in range(0, len(names), 20):  # a write transaction each: a segment each, merged in fours
        with engine.begin() as connection:
            add_jobs(connection, names[first : first + 20], first_id=first + 1)
    table = name_index.FTS_TABLE

    def pages() -> int:
        with engine.connect() as connection:
            return int(connection.execute(text(f"SELECT count(*) FROM {table}_data")).scalar_one())

    before = pages()
    assert name_index.merge_segments(engine) > 0
    assert pages() < before
    assert name_index.merge_segments(engine) == 0  # one piece: nothing left to merge
    stop = threading.Event()
    stop.set()
    with engine.begin() as connection:
        add_jobs(connection, ["late"], first_id=len(names) + 1)
    assert name_index.merge_segments(engine, stop=stop) == 0  # a stopping housekeeper merges nothing
    assert name_index.merge_segments(engine) > 0  # what it left
    with engine.connect() as connection:
        connection.execute(text(f"INSERT INTO {table}({table}, rank) VALUES ('integrity-check', 1)"))
        for substring in substrings(names, rng, 40):
            query = PageQuery(name=substring, limit=500)
            assert walk(connection, query) == scanned(connection, query), substring
