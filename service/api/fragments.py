"""Each job's public JSON, rendered once per version and kept; a list page is those renderings joined.

A job's version is its `updated_at`: every commit that changes the job (its row, its events, its
metrics) restamps it with the ledger clock (service.ledger.clock), and JobPublic is made from the
job's row alone. So (id, updated_at) names exactly one rendering, and a rendering kept under it can
never be stale: a changed job has a new stamp, and the old rendering is simply not asked for again.

What a poll costs then follows what changed, not what was asked: a page is one index query (ids and
stamps, service.domain.jobs.page_index) plus the renderings of the jobs on it, and only the jobs that
changed since they were last rendered are read whole and rendered again. Whose page it is, is the
index query's business (its owner filter) and the single-job read's (the viewer check on the stamp):
a rendering holds one job and is served only where that job is.

Memory is bounded by bytes: least recently used renderings go first (cachetools' LRUCache, sized by
each rendering's length). LastPages keeps each query's joined page (and its tag,
service.api.etag.for_page) for as long as the ledger clock stands still. Renderings are kept by the
event loop and by read threads alike; cachetools' caches are not thread-safe, hence the locks.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from cachetools import LRUCache

from service.domain import jobs
from service.ledger.clock import LedgerVersion
from service.ledger.models.jobs import JobPage, JobPublic

MAX_BYTES = 64 * 2**20  # about 50,000 typical jobs; a page of 500 needs well under 1 MiB
PAGES_MAX_BYTES = 16 * 2**20
_EMPTY_ITEMS = b'{"items":[]'


class Fragments:
    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._kept: LRUCache[int, tuple[datetime, bytes]] = LRUCache(max_bytes, getsizeof=_body_size)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, job_id: int, stamp: datetime) -> bytes | None:
        """The rendering of this job's version `stamp`, if kept."""
        with self._lock:
            kept = self._kept.get(job_id)
            if kept is None or kept[0] != stamp:
                self.misses += 1
                return None
            self.hits += 1
            return kept[1]

    def render(self, job: jobs.JobRow) -> tuple[datetime, bytes]:
        """Render the job as it is in `job` and keep it under its stamp: (stamp, JSON)."""
        public = JobPublic.model_validate(job)
        body = public.model_dump_json().encode()
        self._keep(public.id, public.updated_at, body)
        return public.updated_at, body

    def collect(self, index: jobs.PageIndex) -> PageParts:
        """The kept renderings of the page's jobs; the others are left to complete()."""
        parts = PageParts(index, {})
        for job_id, stamp in index.entries:
            body = self.get(job_id, stamp)
            if body is not None:
                parts.bodies[job_id] = body
        return parts

    def complete(self, parts: PageParts, found: list[jobs.JobRow]) -> None:
        """Render the jobs collect() found no rendering for, read whole (`found`). A job changed since
        the index was read is rendered as it is now (newer than the page's tag, never older); one
        deleted meanwhile is left out."""
        for job in found:
            parts.bodies[job["id"]] = self.render(job)[1]

    def size(self) -> tuple[int, int]:
        """(renderings kept, their bytes)."""
        with self._lock:
            return len(self._kept), int(self._kept.currsize)

    def _keep(self, job_id: int, stamp: datetime, body: bytes) -> None:
        if len(body) > self.max_bytes:
            return
        with self._lock:
            kept = self._kept.get(job_id)
            if kept is not None and kept[0] > stamp:
                return  # a reader that raced a commit must not put an older version back
            self._kept[job_id] = (stamp, body)


def _body_size(kept: tuple[datetime, bytes]) -> int:
    return len(kept[1])


@dataclass(frozen=True)
class Page:
    """A joined list page: its tag (service.api.etag.for_page) and its JSON."""

    tag: str
    body: bytes


class LastPages:
    """Each query's page as last joined, kept while the ledger clock stays where it was read.

    A quiet ledger's polls then cost the clock read alone; the first commit makes every kept page
    useless (a newer clock value is never answered from an older one), and the next poll of each
    query reads its index again and joins it from the renderings (its tag is unchanged when the
    commit touched no job on it). Bounded by bytes, least recently used first.
    """

    def __init__(self, max_bytes: int = PAGES_MAX_BYTES) -> None:
        self._max = max_bytes
        self._pages: LRUCache[jobs.PageQuery, tuple[LedgerVersion, Page]] = LRUCache(
            max_bytes, getsizeof=_page_size
        )
        self._lock = threading.Lock()
        self._joining: dict[tuple[jobs.PageQuery, LedgerVersion], asyncio.Future[Page]] = {}

    async def joined(
        self, query: jobs.PageQuery, version: LedgerVersion, join: Callable[[], Awaitable[Page]]
    ) -> Page:
        """The page kept for this clock, or joined once (`join`) for every poll that asks for it
        meanwhile: a commit moves the clock under 50 pollers at once, and while one poll's page read
        awaited the database (PostgreSQL, from the event loop), each of the others read it again,
        and the list's rate fell far behind (bench.poll --busy 20). Event-loop thread only."""
        page = self.get(query, version)
        if page is not None:
            return page
        key = (query, version)
        joining = self._joining.get(key)
        if joining is None:
            joining = self._joining[key] = asyncio.ensure_future(join())
            joining.add_done_callback(functools.partial(self._joined, key))
        # shield: a poll that hangs up must not cancel the join the others are waiting for
        return await asyncio.shield(joining)

    def _joined(self, key: tuple[jobs.PageQuery, LedgerVersion], joining: asyncio.Future[Page]) -> None:
        del self._joining[key]
        if not joining.cancelled() and joining.exception() is None:
            self.put(*key, joining.result())

    def get(self, query: jobs.PageQuery, version: LedgerVersion) -> Page | None:
        with self._lock:
            kept = self._pages.get(query)
        return kept[1] if kept is not None and kept[0] == version else None

    def put(self, query: jobs.PageQuery, version: LedgerVersion, page: Page) -> None:
        if len(page.body) > self._max:
            return
        with self._lock:
            self._pages[query] = (version, page)


def _page_size(kept: tuple[LedgerVersion, Page]) -> int:
    return len(kept[1].body)


@dataclass
class PageParts:
    """A page on its way: its index and the renderings found so far."""

    index: jobs.PageIndex
    bodies: dict[int, bytes]

    def missing(self) -> list[int]:
        return [job_id for job_id, _ in self.index.entries if job_id not in self.bodies]

    def join(self, server_time: datetime) -> bytes:
        """The page as JobPage would write it: the envelope from JobPage itself, the items spliced in."""
        envelope = JobPage(items=[], next_cursor=self.index.next_cursor, server_time=server_time)
        written = envelope.model_dump_json().encode()
        assert written.startswith(_EMPTY_ITEMS)  # JobPage's first field is its items
        items = b",".join(self.bodies[job_id] for job_id, _ in self.index.entries if job_id in self.bodies)
        return b'{"items":[' + items + b"]" + written[len(_EMPTY_ITEMS) :]
