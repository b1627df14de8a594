"""`?state=` pages without a name on SQLite and PostgreSQL: each state is a walk of its own index
(service.domain.jobs._state_page), and the pages, walked cursor after cursor, are exactly what a
plain scan of every job answers, for one state or several, an owner's or everyone's, with `since`."""

from __future__ import annotations

import random
from dataclasses import replace
from datetime import timedelta
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection, Engine
from sqlmodel import col

from service.api.reader import LedgerReader
from service.domain.jobs import PageIndex, PageQuery, _page_statement, page_index
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.support import run_async

OWNERS = ("alice", "bob", "carol")


def add_jobs(connection: Connection, count: int, rng: random.Random) -> None:
    now = utcnow()
    states = list(JobState)
    rows: list[dict[str, Any]] = [
        {"id": job_id, "name": f"job-{job_id}", "owner": rng.choice(OWNERS), "backend": "local",
         "state": rng.choice(states).value, "spec": {}, "attempt": 1, "progress_offset": 0,
         "cancel_requested": False, "created_at": now, "updated_at": now + timedelta(seconds=job_id % 7)}
        for job_id in range(1, count + 1)
    ]  # fmt: skip
    connection.execute(insert(Job), rows)


def walk(connection: Connection, query: PageQuery) -> list[int]:
    found: list[int] = []
    while True:
        page = page_index(connection, query)
        assert len(page.entries) <= query.limit
        found += [job_id for job_id, _ in page.entries]
        if page.next_cursor is None:
            return found
        query = PageQuery(query.state, None, query.owner, page.next_cursor, query.limit, query.updated_since)


def scanned(connection: Connection, query: PageQuery) -> list[int]:
    columns = (col(Job.id), col(Job.owner), col(Job.state), col(Job.updated_at))
    rows = connection.execute(select(*columns).order_by(col(Job.id).desc())).all()
    wanted = {state.value for state in query.state}
    return [
        job_id
        for job_id, owner, state, updated_at in rows
        if job_id is not None
        and state in wanted
        and query.owner in (None, owner)
        and (query.updated_since is None or updated_at >= query.updated_since)
    ]


def test_state_pages_answer_what_a_plain_scan_answers(engine: Engine) -> None:
    rng = random.Random(7)
    with engine.begin() as connection:
        add_jobs(connection, 700, rng)
    since = utcnow() + timedelta(seconds=4)
    states = list(JobState)
    with engine.connect() as connection:
        for n in range(60):
            chosen = rng.sample(states, rng.randint(1, 4))
            query = PageQuery(
                state=(*chosen, chosen[0]) if n % 7 == 3 else tuple(chosen),  # a state named twice
                owner=rng.choice(OWNERS) if n % 2 else None,
                limit=rng.choice([1, 7, 50, 500]),
                updated_since=since if n % 5 == 2 else None,
            )
            expected = scanned(connection, query)
            assert walk(connection, query) == expected, query


def test_on_sqlite_each_state_is_a_walk_of_its_index(engine: Engine) -> None:
    """Each state's rows come from its index, `limit` at most (a union sorts only those); no job
    row is read past the page."""
    if engine.dialect.name != "sqlite":
        return  # PostgreSQL's plan follows its statistics: bench.scale measures it at 10^6 jobs
    given = {"state0": "running", "state1": "queued", "owner": "alice", "since": utcnow(), "before": 10}
    for shape, index in [((1, False, False, False, True), "ix_job_state_id"),
                         ((2, False, True, True, True), "ix_job_owner_state_id")]:  # fmt: skip
        compiled = _page_statement("sqlite", shape).compile(engine)
        values = {**compiled.params, **given, "limit": 51}
        positional = tuple(values[key] for key in compiled.positiontup or ())
        with engine.connect() as connection:
            explained = connection.exec_driver_sql("EXPLAIN QUERY PLAN " + compiled.string, positional)
            plan = [row[-1] for row in explained]
        reads = [line for line in plan if " job " in f"{line} "]
        assert len(reads) == shape[0], plan
        assert all(line.startswith(f"SEARCH job USING INDEX {index} (") for line in reads), plan


def test_the_readers_pages_are_page_index_pages(engine: Engine) -> None:
    """service.api.reader makes the same reads on its own connections (PostgreSQL: asynchronous,
    from the event loop, through the driver's cursor): the same pages, cursors and stamps."""
    rng = random.Random(11)
    with engine.begin() as connection:
        add_jobs(connection, 300, rng)
    since = utcnow() + timedelta(seconds=3)
    queries = [
        PageQuery(limit=20),
        PageQuery(state=(JobState.running,), limit=7),
        PageQuery(state=(JobState.failed, JobState.queued), owner="bob", limit=5),
        PageQuery(name="job-1", limit=9),
        PageQuery(name="OB-2", state=(JobState.running, JobState.succeeded), updated_since=since, limit=3),
        PageQuery(owner="alice", updated_since=since, limit=11),
    ]
    reader = LedgerReader(engine)

    async def pages(query: PageQuery) -> list[PageIndex]:
        found = [await reader.page_index(query)]
        while found[-1].next_cursor is not None and len(found) < 4:
            query = replace(query, cursor=found[-1].next_cursor)
            found.append(await reader.page_index(query))
        return found

    try:
        for query in queries:
            got = run_async(pages(query))
            with engine.connect() as connection:
                expected = [page_index(connection, replace(query, cursor=None))]
                while expected[-1].next_cursor is not None and len(expected) < 4:
                    cursor = expected[-1].next_cursor
                    expected.append(page_index(connection, replace(query, cursor=cursor)))
            assert got == expected, query
            assert got[0].entries, query
    finally:
        reader.close()
