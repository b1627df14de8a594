"""The watchdog's decision: is a running attempt stalled? Pure: no I/O, no clock of its own.

Progress is what the ledger and the job folder already hold, so a decision costs no scheduler query:
- the job's reports (`ctx.report`), as the service read them: when it last read a new one
  (`Job.progress_at`, its own clock) and the times of the last ones (`Job.report_times`, rank 0's
  clock: their gaps are the job's pace);
- its ranks' activity files (worker.stacks, every ACTIVITY_INTERVAL_S): when each rank's main
  thread last ran something else than at the sample before (`changed_at`). A rank whose file went
  stale (its Python cannot run: C code holding the GIL) counts as not changing since.

The attempt last moved at the latest of its last report and the moment the LAST of its ranks last
changed (a rank that stopped stops the job: the others wait for it in a collective). It is stalled
when that is `threshold` ago: the spec's `watchdog.stall_after_s`, else adapted to the job's pace:
max(120 s, 10x the median gap between its recent reports), or 300 s for a job that has not reported
twice (then its ranks' activity is all there is to go by). A job with neither reports nor activity
files (a worker older than the watchdog) is never called stalled: nothing says what it does.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from service.domain.stacks import format_ranks
from worker.spec import ACTIVITY_INTERVAL_S, Watchdog

MIN_ADAPTIVE_S = 120.0
PACE_FACTOR = 10.0
NO_PACE_S = 300.0  # a job with fewer than two reports: its ranks' activity decides
KEPT_REPORT_TIMES = 16  # the report times kept per attempt (Job.report_times): its pace's window
STALE_AFTER_S = 3 * ACTIVITY_INTERVAL_S  # an activity file older than this: its rank's Python is stuck
MAX_WHERE_CHARS = 200


class Activity(Protocol):
    """What the watchdog reads of a rank's activity file (worker.spec's RankActivity has these)."""

    @property
    def rank(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def time(self) -> float: ...
    @property
    def changed_at(self) -> float: ...
    @property
    def where(self) -> str | None: ...


@dataclass(frozen=True)
class Verdict:
    stalled: bool
    threshold_s: float
    basis: str  # how the threshold was chosen, for the reason
    idle_s: float | None  # seconds since the attempt last moved (None: nothing to go by)
    reason: str | None  # for a stalled attempt: how long, and which rank is where (from activity)
    idle: str | None = None  # the reason's first part alone: how long, and the threshold


def threshold(watchdog: Watchdog | None, report_times: Sequence[float]) -> tuple[float, str]:
    """The seconds without progress that make this job stalled, and how they were chosen."""
    if watchdog is not None and watchdog.stall_after_s is not None:
        return watchdog.stall_after_s, "its watchdog.stall_after_s"
    gaps = [later - earlier for earlier, later in itertools.pairwise(report_times) if later >= earlier]
    if not gaps:
        return NO_PACE_S, "the default for a job that has not reported twice"
    pace = statistics.median(gaps)
    if PACE_FACTOR * pace <= MIN_ADAPTIVE_S:
        return MIN_ADAPTIVE_S, f"at least {MIN_ADAPTIVE_S:g} s (it reports every {pace:.3g} s)"
    return PACE_FACTOR * pace, f"{PACE_FACTOR:g}x its usual {pace:.3g} s between reports"


def last_changes(
    activity: Sequence[Activity], attempt: int, world: int, started_at: float | None, now: float
) -> dict[int, float] | None:
    """When each rank of `attempt` last changed what it runs (None: no rank wrote an activity file of
    this attempt). A rank without a file counts from the attempt's start; a stale file's rank from its
    last sample at the latest; times ahead of `now` (another host's clock) count as now."""
    mine = {one.rank: one for one in activity if one.attempt == attempt and 0 <= one.rank < world}
    if not mine:
        return None
    changes: dict[int, float] = {}
    for rank in range(world):
        one = mine.get(rank)
        if one is None:
            changes[rank] = started_at if started_at is not None else now
        else:
            changes[rank] = min(one.changed_at, one.time, now)
    return changes


def decide(
    *,
    now: float,
    watchdog: Watchdog | None,
    attempt: int,
    world: int,
    started_at: float | None,
    progress_at: float | None,
    report_times: Sequence[float],
    activity: Sequence[Activity],
) -> Verdict:
    """Whether the running attempt is stalled at `now` (the service's epoch seconds)."""
    limit, basis = threshold(watchdog, report_times)
    changes = last_changes(activity, attempt, world, started_at, now)
    moments = [moment for moment in (progress_at, min(changes.values()) if changes else None) if moment]
    if not moments:
        return Verdict(False, limit, basis, None, None)
    moved = max(moments)
    if started_at is not None:
        moved = max(moved, started_at)
    idle = max(0.0, now - moved)
    if idle < limit:
        return Verdict(False, limit, basis, idle, None)
    said = f"no progress for {_duration(idle)} (threshold {limit:g} s: {basis})"
    where = _where(activity, attempt, world, changes or {}, now)
    return Verdict(True, limit, basis, idle, f"{said}; {where}" if where else said, said)


def _where(
    activity: Sequence[Activity], attempt: int, world: int, changes: dict[int, float], now: float
) -> str:
    """Which rank is where, by the activity files: ranks at the same place together, the smallest
    group (the odd rank) first."""
    mine = {one.rank: one for one in activity if one.attempt == attempt and 0 <= one.rank < world}
    groups: dict[str, list[int]] = {}
    for rank in range(world):
        one = mine.get(rank)
        if one is None:
            place = "wrote no activity"
        elif now - one.time > STALE_AFTER_S:
            place = f"stopped sampling (its Python cannot run) in {_place(one.where)}"
        else:
            place = f"in {_place(one.where)}"
        groups.setdefault(place, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1][0]))
    parts = []
    for index, (place, ranks) in enumerate(ordered):
        if len(ranks) == 1:
            rank = ranks[0]
            host = mine[rank].host if rank in mine else None
            since = f" for {_duration(now - changes[rank])}" if index == 0 and rank in changes else ""
            parts.append(f"rank {rank}{f' on {host}' if host else ''} {_has_been(place)}{since}")
        else:
            parts.append(f"ranks {format_ranks(ranks)} {place}")
    return "; ".join(parts)


def _has_been(place: str) -> str:
    return f"has been {place}" if place.startswith("in ") else place


def _place(where: str | None) -> str:
    return (where or "an unknown place")[:MAX_WHERE_CHARS]


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def recent_report_times(kept: Sequence[float] | None, new: Sequence[float]) -> list[float]:
    """The report times kept for the pace: the last KEPT_REPORT_TIMES of `kept` and then `new`."""
    return [*(kept or []), *new][-KEPT_REPORT_TIMES:]
