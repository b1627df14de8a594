"""Entity tags for polling readers: built from the ledger clock or a job's stamp, never from a body.

A 304 must cost less than the 200 it replaces, so the tag comes from one tiny read (the clock row,
or one job's `updated_at` by primary key) taken before the data; the body is never built to hash it.
Every commit that changes a job bumps the clock and restamps the job (service.ledger.clock), so:
- a job list page's tag is what the page holds: the query (whose jobs, which filters, where it
  starts) and its index, each job's (id, updated_at) and the next cursor. A change to a job on the
  page, a job that joins or leaves it, changes the tag; a busy ledger whose changes are elsewhere
  does not, and its pollers keep getting 304s. The page's server_time is not in it (a 304 leaves the
  client its older server_time: a `since` from it reads more, never less), so the tag is weak;
- other lists' tags (sweeps) are the clock: any change anywhere changes them (some revalidate for
  nothing, none is ever stale);
- a job's tag (and its events' and metrics') is that job's stamp: a job's own change, its new events
  and new metrics all restamp it.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

from service.domain import jobs
from service.ledger.clock import LedgerVersion

SERVER_TIME_HEADER = "X-Server-Time"


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
_MICROSECOND = timedelta(microseconds=1)


def _micros(when: datetime) -> int:
    # Exact arithmetic rather than timestamp()'s float: cheaper, and a page's tag takes one per job
    # on it.
    return (when - _EPOCH) // _MICROSECOND


def for_ledger(version: LedgerVersion, viewer: str | None = None) -> str:
    """`viewer`: whose jobs the page holds (None: everyone's), so one user's tag never fits another's page."""
    # The stamp is in the tag too: a fresh ledger restarts seq at 0 and must not match an old tag.
    scope = "*" if viewer is None else viewer
    return f'"l{version.seq}.{_micros(version.stamped_at)}.{scope}"'


def for_page(query: jobs.PageQuery, index: jobs.PageIndex) -> str:
    """A job list page's tag: its query (the owner filter in it: another viewer's page never shares
    a tag) and the versions of the jobs on it."""
    entries = ",".join(f"{job_id}.{_micros(stamp)}" for job_id, stamp in index.entries)
    held = f"{query!r}|{entries}|{index.next_cursor}"
    return f'W/"p{hashlib.blake2b(held.encode(), digest_size=16).hexdigest()}"'


def for_job(job_id: int, updated_at: datetime) -> str:
    return f'"j{job_id}.{_micros(updated_at)}"'


def matches(if_none_match: str | None, tag: str) -> bool:
    """RFC 9110 weak comparison against an If-None-Match header (a list of tags, or `*`)."""
    if not if_none_match:
        return False
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == tag.removeprefix("W/"):
            return True
    return False


def headers(tag: str, server_time: datetime | None = None) -> dict[str, str]:
    """`no-cache`: caches may keep the body but must ask (If-None-Match) before every reuse."""
    out = {"ETag": tag, "Cache-Control": "no-cache"}
    if server_time is not None:
        out[SERVER_TIME_HEADER] = server_time.isoformat()
    return out
