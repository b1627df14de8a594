"""Long metric series at any zoom: at most N points per series, each bucket's first, lowest, highest
and last point (M4), so a spike survives every zoom level, read in bounded time however long the run.

A GROUP BY over a long run's raw rows reads every one of them at every zoom (docs/performance.md,
Figures behind the design), so the buckets are kept ready in
`JobMetricRollup`: level k (1..LEVELS) holds buckets of 8**k steps, each made from the eight buckets
below it (level 0: the raw `JobMetric` rows). `refresh` recomputes the buckets over the steps that
just arrived; `read_series` picks the finest level that has at most N buckets over the asked range
and merges them into N/4 buckets of the answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any, NamedTuple

from sqlalchemy import ColumnElement, Connection, and_, delete, func, insert, or_, select
from sqlmodel import Session, col

from service.domain.auth import Principal
from service.domain.jobs import get_job
from service.errors import InvalidRequest
from service.ledger.models.metrics import JobMetric, JobMetricRollup, MetricSeries, MetricSeriesPage

FACTOR = 8  # steps of a level-k bucket: FACTOR**k; the rollup holds 1/7 as many rows as the series
LEVELS = 7  # a whole 2**31-step series is at most 1024 buckets of the top level
POINTS_PER_BUCKET = 4  # first, lowest, highest, last
MAX_POINTS = 10_000

Point = tuple[int, float]  # (step, value)


@dataclass(frozen=True)
class SeriesKey:
    """One series: a metric of one attempt of one job (a resumed attempt may repeat steps)."""

    job_id: int
    name: str
    attempt: int


class Bucket(NamedTuple):  # a tuple, not a dataclass: a full rebuild makes one per raw row
    size: int  # raw points
    first: Point
    last: Point
    low: Point
    high: Point

    @classmethod
    def of(cls, step: int, value: float) -> Bucket:
        point = (step, value)
        return cls(1, point, point, point, point)

    def merge(self, later: Bucket) -> Bucket:
        """This bucket and one that starts no earlier, as one."""
        return Bucket(
            size=self.size + later.size,
            first=later.first if later.first[0] < self.first[0] else self.first,
            last=later.last if later.last[0] >= self.last[0] else self.last,
            low=later.low if later.low[1] < self.low[1] else self.low,
            high=later.high if later.high[1] > self.high[1] else self.high,
        )

    def points(self) -> list[Point]:
        return sorted(set((self.first, self.low, self.high, self.last)))


# ---------------------------------------------------------------- writing


def refresh(connection: Connection, key: SeriesKey, first_step: int, last_step: int) -> None:
    """Rebuild every level's buckets that hold steps `first_step..last_step` from the level below.

    Called in the transaction that added raw rows in that range (flushed), so a reader never sees
    rows without their buckets. Four statements whatever the number of levels: the raw rows and the
    stored buckets the new ones are made from, read once each, then one delete and one insert."""
    spans = {
        level: (first_step // FACTOR**level, last_step // FACTOR**level) for level in range(1, LEVELS + 1)
    }
    # Level k's buckets lo..hi are made from level k-1's buckets lo*FACTOR..hi*FACTOR+FACTOR-1.
    sources = {level - 1: (lo * FACTOR, hi * FACTOR + FACTOR - 1) for level, (lo, hi) in spans.items()}
    children: dict[int, Bucket] = {}
    for step, point in _read_raw(connection, key, *sources[0]):
        known = children.get(step)
        children[step] = point if known is None else known.merge(point)
    stored = _read_rollup(connection, key, {level: span for level, span in sources.items() if level > 0})
    rows: list[dict[str, object]] = []
    for level, (lo, hi) in spans.items():
        parents: dict[int, Bucket] = {}
        for index in sorted(children):
            parent = parents.get(index // FACTOR)
            parents[index // FACTOR] = children[index] if parent is None else parent.merge(children[index])
        rows.extend(_row(key, level, index, bucket) for index, bucket in parents.items())
        kept = stored.get(level, {})
        children = {index: bucket for index, bucket in kept.items() if not lo <= index <= hi} | parents
    table = JobMetricRollup.__table__  # type: ignore[attr-defined]
    connection.execute(
        delete(table).where(
            _series(table, key),
            or_(
                *(
                    and_(table.c.level == level, table.c.bucket.between(lo, hi))
                    for level, (lo, hi) in spans.items()
                )
            ),
        )
    )
    if rows:
        connection.execute(insert(table), rows)


def _series(table: Any, key: SeriesKey) -> ColumnElement[bool]:
    return and_(table.c.job_id == key.job_id, table.c.name == key.name, table.c.attempt == key.attempt)


def _row(key: SeriesKey, level: int, index: int, bucket: Bucket) -> dict[str, object]:
    return {
        "job_id": key.job_id,
        "level": level,
        "name": key.name,
        "attempt": key.attempt,
        "bucket": index,
        "count": bucket.size,
        "first_step": bucket.first[0],
        "first_value": bucket.first[1],
        "last_step": bucket.last[0],
        "last_value": bucket.last[1],
        "min_step": bucket.low[0],
        "min_value": bucket.low[1],
        "max_step": bucket.high[0],
        "max_value": bucket.high[1],
    }


def _read_level(
    connection: Connection, key: SeriesKey, level: int, lo: int, hi: int
) -> list[tuple[int, Bucket]]:
    """(index, bucket) of one level, lo..hi, in order; level 0 is the raw rows, indexed by step."""
    if level == 0:
        return _read_raw(connection, key, lo, hi)
    return sorted(_read_rollup(connection, key, {level: (lo, hi)}).get(level, {}).items())


def _read_raw(connection: Connection, key: SeriesKey, lo: int, hi: int) -> list[tuple[int, Bucket]]:
    """Every raw point of steps lo..hi as a bucket of its own, in step order."""
    raw = (
        select(col(JobMetric.step), col(JobMetric.value))
        .where(
            col(JobMetric.job_id) == key.job_id,
            col(JobMetric.name) == key.name,
            col(JobMetric.attempt) == key.attempt,
            col(JobMetric.step).between(lo, hi),
        )
        .order_by(col(JobMetric.step), col(JobMetric.id))
    )
    return [(step, Bucket.of(step, value)) for step, value in connection.execute(raw)]


def _read_rollup(
    connection: Connection, key: SeriesKey, spans: dict[int, tuple[int, int]]
) -> dict[int, dict[int, Bucket]]:
    """The stored buckets of several levels at once: {level: {index: bucket}} over each level's span."""
    table = JobMetricRollup.__table__  # type: ignore[attr-defined]
    c = table.c
    query = select(
        c.level, c.bucket, c.count, c.first_step, c.first_value, c.last_step, c.last_value,
        c.min_step, c.min_value, c.max_step, c.max_value,
    ).where(
        _series(table, key),
        or_(*(and_(c.level == level, c.bucket.between(lo, hi)) for level, (lo, hi) in spans.items())),
    )  # fmt: skip
    levels: dict[int, dict[int, Bucket]] = {}
    for row in connection.execute(query):
        bucket = Bucket(row[2], (row[3], row[4]), (row[5], row[6]), (row[7], row[8]), (row[9], row[10]))
        levels.setdefault(row[0], {})[row[1]] = bucket
    return levels


def refresh_added(connection: Connection, job_id: int, added: Iterable[tuple[str, int, int]]) -> None:
    """After raw rows (name, attempt, step) were added: refresh each touched series over its steps."""
    spans: dict[SeriesKey, tuple[int, int]] = {}
    for name, attempt, step in added:
        key = SeriesKey(job_id, name, attempt)
        lo, hi = spans.get(key, (step, step))
        spans[key] = (min(lo, step), max(hi, step))
    for key, (lo, hi) in spans.items():
        refresh(connection, key, lo, hi)


# ---------------------------------------------------------------- reading


def series_sizes(connection: Connection, job_id: int) -> dict[str, int]:
    """The job's metric names and how many values each holds (all attempts), read from the rollup's
    top level: a bucket or so per series, however many raw rows there are."""
    r = JobMetricRollup
    query = (
        select(col(r.name), func.sum(col(r.count)))
        .where(col(r.job_id) == job_id, col(r.level) == LEVELS)
        .group_by(col(r.name))
    )
    return {name: int(count) for name, count in connection.execute(query)}


def read_series(
    session: Session,
    job_id: int,
    viewer: Principal,
    *,
    points: int,
    from_step: int | None = None,
    to_step: int | None = None,
) -> MetricSeriesPage:
    """Every series of the job over from_step..to_step (default: all of it), at most `points` each."""
    if from_step is not None and to_step is not None and to_step < from_step:
        raise InvalidRequest("must not be below from_step", field="to_step")
    get_job(session, job_id, viewer)
    connection = session.connection()
    r = JobMetricRollup
    spans = (
        select(col(r.name), col(r.attempt), func.min(r.first_step), func.max(r.last_step))
        .where(col(r.job_id) == job_id, col(r.level) == LEVELS)
        .group_by(col(r.name), col(r.attempt))
        .order_by(col(r.name), col(r.attempt))
    )
    series = []
    for name, attempt, first, last in connection.execute(spans).all():
        lo = first if from_step is None else max(first, from_step)
        hi = last if to_step is None else min(last, to_step)
        series.append(_downsample(connection, SeriesKey(job_id, name, attempt), lo, hi, points))
    return MetricSeriesPage(points=points, from_step=from_step, to_step=to_step, series=series)


def _downsample(connection: Connection, key: SeriesKey, lo: int, hi: int, points: int) -> MetricSeries:
    if hi < lo:
        return MetricSeries(name=key.name, attempt=key.attempt, steps=[], values=[], downsampled=False)
    span = hi - lo + 1
    # The finest level with at most N buckets over the range (so more than N/8 of them).
    level = next((k for k in range(LEVELS + 1) if span <= points * FACTOR**k), LEVELS)
    children = _read_level(connection, key, level, lo // FACTOR**level, hi // FACTOR**level)
    if level == 0 and len(children) <= points:
        steps = [step for step, _ in children]
        values = [bucket.first[1] for _, bucket in children]
        return MetricSeries(name=key.name, attempt=key.attempt, steps=steps, values=values, downsampled=False)
    kept = _merge(children, lo, span, max(1, points // POINTS_PER_BUCKET))
    inside = [(step, value) for step, value in kept if lo <= step <= hi]  # edge buckets reach past
    return MetricSeries(
        name=key.name,
        attempt=key.attempt,
        steps=[step for step, _ in inside],
        values=[value for _, value in inside],
        downsampled=True,
    )


def _merge(children: Sequence[tuple[int, Bucket]], lo: int, span: int, buckets: int) -> list[Point]:
    """The children in `buckets` equal slices of lo..lo+span-1, each slice's M4 points, in step order."""
    slices: dict[int, list[Bucket]] = {}
    for _, child in children:
        index = min(buckets - 1, max(0, (child.first[0] - lo) * buckets // span))
        slices.setdefault(index, []).append(child)
    out: list[Point] = []
    for index in sorted(slices):
        out.extend(reduce(Bucket.merge, slices[index]).points())
    return out
