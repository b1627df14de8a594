"""The read path's two keepers: renderings per job version and pages per clock value, both bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta, timezone

from service.api.fragments import Fragments, LastPages, Page
from service.domain.jobs import JobRow, PageQuery
from service.ledger.clock import LedgerVersion
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.support import run_async

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def job(job_id: int, stamp: datetime, name: str = "job") -> JobRow:
    """A job's columns, as the reader reads them (service.domain.jobs.job_reads)."""
    return Job(
        id=job_id,
        name=name,
        owner="alice",
        backend="local",
        state=JobState.running,
        spec={"entrypoint": "worker.tasks.seed:ddp_step"},
        attempt=1,
        progress_offset=0,
        cancel_requested=False,
        created_at=T0,
        updated_at=stamp,
    ).model_dump()


def test_a_rendering_answers_only_for_its_own_version() -> None:
    fragments = Fragments()
    stamp, body = fragments.render(job(1, T0, name="first"))

    assert stamp == T0 and fragments.get(1, T0) == body and b'"first"' in body
    assert fragments.get(1, T0 + timedelta(microseconds=1)) is None  # a newer version: not this one
    newer = T0 + timedelta(seconds=1)
    fragments.render(job(1, newer, name="second"))
    fragments.render(job(1, T0, name="first"))  # a reader that raced the commit: not put back
    assert fragments.get(1, T0) is None and b'"second"' in (fragments.get(1, newer) or b"")


def test_renderings_are_bounded_by_bytes_least_recently_used_first() -> None:
    one = len(Fragments().render(job(1, T0))[1])
    fragments = Fragments(max_bytes=10 * one + one // 2)
    for job_id in range(1, 1001):
        fragments.render(job(job_id, T0))
        fragments.get(1, T0)  # kept in use: never the one let go

    kept, kept_bytes = fragments.size()
    assert kept == 10 and kept_bytes <= fragments.max_bytes
    assert fragments.get(1, T0) is not None and fragments.get(1000, T0) is not None
    assert fragments.get(500, T0) is None


def test_a_page_is_kept_only_while_the_clock_stands_still_and_within_its_bytes() -> None:
    pages = LastPages(max_bytes=1000)
    query, other = PageQuery(owner="alice"), PageQuery(owner="bob")
    now = LedgerVersion(7, T0)
    alices = Page('W/"p1"', b"alice's page")
    pages.put(query, now, alices)

    assert pages.get(query, now) == alices
    assert pages.get(other, now) is None  # another viewer's query: never this page
    assert pages.get(query, LedgerVersion(8, T0 + timedelta(microseconds=1))) is None
    for n in range(20):
        pages.put(PageQuery(owner=f"user{n}"), now, Page(f'W/"p{n}"', b"x" * 100))
    assert pages.get(query, now) is None  # let go to stay within 1000 bytes
    assert pages.get(PageQuery(owner="user19"), now) == Page('W/"p19"', b"x" * 100)


def test_the_polls_that_miss_one_page_together_join_it_once() -> None:
    """A commit moves the clock under every poller at once: one join for all of them, kept for the
    next; a newer clock joins again; a failed join is every waiter's error and keeps nothing."""
    pages, joins = LastPages(), []
    now, later = LedgerVersion(1, T0), LedgerVersion(2, T0 + timedelta(seconds=1))
    query = PageQuery(owner="alice")

    def join_for(version: LedgerVersion, fail: bool = False) -> Callable[[], Awaitable[Page]]:
        async def join() -> Page:
            joins.append(version.seq)
            await asyncio.sleep(0.01)  # the database answers meanwhile
            if fail:
                raise ConnectionError("the database is down")
            return Page(f'W/"p{version.seq}"', b"[]")

        return join

    async def scenario() -> None:
        first = await asyncio.gather(*(pages.joined(query, now, join_for(now)) for _ in range(20)))
        assert {page.tag for page in first} == {'W/"p1"'} and joins == [1]
        assert await pages.joined(query, now, join_for(now)) == first[0] and joins == [1]  # kept
        failing = [pages.joined(query, later, join_for(later, fail=True)) for _ in range(5)]
        failed = await asyncio.gather(*failing, return_exceptions=True)
        assert all(isinstance(answer, ConnectionError) for answer in failed) and joins == [1, 2]
        assert pages.get(query, later) is None
        assert (await pages.joined(query, later, join_for(later))).tag == 'W/"p2"' and joins == [1, 2, 2]

    run_async(scenario())
