"""Entity tags for polling readers: built from the ledger clock or a job's stamp, never from a body.

A 304 must cost less than the 200 it replaces, so the tag comes from one tiny read (the clock row,
or one job's `updated_at` by primary key) taken before the data; the body is never built to hash it.
Every commit that changes a job bumps the clock and restamps the job (service.ledger.clock), so:
- a list page's tag is the clock itself: any change anywhere changes every page's tag (some pages
  revalidate for nothing, none is ever stale);
- a job's tag (and its events' and metrics') is that job's stamp: a job's own change, its new events
  and new metrics all restamp it.
"""

from __future__ import annotations

from datetime import datetime

from service.ledger.clock import LedgerVersion

SERVER_TIME_HEADER = "X-Server-Time"


def _micros(when: datetime) -> int:
    return int(when.timestamp() * 1_000_000)


def for_ledger(version: LedgerVersion, viewer: str | None = None) -> str:
    """`viewer`: whose jobs the page holds (None: everyone's), so one user's tag never fits another's page."""
    # The stamp is in the tag too: a fresh ledger restarts seq at 0 and must not match an old tag.
    scope = "*" if viewer is None else viewer
    return f'"l{version.seq}.{_micros(version.stamped_at)}.{scope}"'


def for_job(job_id: int, updated_at: datetime) -> str:
    return f'"j{job_id}.{_micros(updated_at)}"'


def matches(if_none_match: str | None, tag: str) -> bool:
    """RFC 9110 weak comparison against an If-None-Match header (a list of tags, or `*`)."""
    if not if_none_match:
        return False
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == tag:
            return True
    return False


def headers(tag: str, server_time: datetime | None = None) -> dict[str, str]:
    """`no-cache`: caches may keep the body but must ask (If-None-Match) before every reuse."""
    out = {"ETag": tag, "Cache-Control": "no-cache"}
    if server_time is not None:
        out[SERVER_TIME_HEADER] = server_time.isoformat()
    return out
