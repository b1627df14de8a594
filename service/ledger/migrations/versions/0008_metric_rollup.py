"""metric rollup (every metric series in buckets of 8**k steps, so long runs stay viewable) and the
scheduler's start estimate of a waiting job

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("expected_start_at", UTCDateTime(timezone=True), nullable=True))
    op.create_index("ix_jobmetric_series", "jobmetric", ["job_id", "name", "attempt", "step"])
    op.create_table(
        "jobmetricrollup",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("job.id"), nullable=False),
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("count", sa.Integer(), nullable=False),
        *(
            sa.Column(f"{end}_{part}", sa.Integer() if part == "step" else sa.Float(), nullable=False)
            for end in ("first", "last", "min", "max")
            for part in ("step", "value")
        ),
    )
    op.create_index(
        "ix_jobmetricrollup_bucket",
        "jobmetricrollup",
        ["job_id", "level", "name", "attempt", "bucket"],
        unique=True,
    )
    _backfill()


# What the rollup was when this migration was written (service.domain.metric_series then), frozen
# here: a migration must do tomorrow what it did the day it shipped, and the live module follows
# the newest schema, not this revision's. tests/api/test_migrations.py checks that it still builds
# the buckets the live code builds.
FACTOR = 8
LEVELS = 7
_METRIC = sa.table(
    "jobmetric",
    *(sa.column(name) for name in ("id", "job_id", "name", "attempt", "step", "value")),
)
_ROLLUP = sa.table(
    "jobmetricrollup",
    *(sa.column(name) for name in ("job_id", "level", "name", "attempt", "bucket", "count")),
    *(sa.column(f"{end}_{part}") for end in ("first", "last", "min", "max") for part in ("step", "value")),
)
Point = tuple[int, float]
Bucket = tuple[int, Point, Point, Point, Point]  # raw points; first, last, lowest, highest point


def _merge(earlier: Bucket, later: Bucket) -> Bucket:
    """Two buckets as one; `later` starts no earlier. Ties keep the first point seen, but the last."""
    size, first, last, low, high = earlier
    return (
        size + later[0],
        later[1] if later[1][0] < first[0] else first,
        later[2] if later[2][0] >= last[0] else last,
        later[3] if later[3][1] < low[1] else low,
        later[4] if later[4][1] > high[1] else high,
    )


def _series_buckets(points: list[Point]) -> dict[int, dict[int, Bucket]]:
    """{level: {index: bucket}} for one series' points in (step, id) order: level k's buckets are
    made from level k-1's in index order (not from the raw points: with NaN values the order of
    comparisons decides the lowest and highest point)."""
    children: dict[int, Bucket] = {}
    for step, value in points:
        point = (step, value)
        bucket: Bucket = (1, point, point, point, point)
        children[step] = bucket if step not in children else _merge(children[step], bucket)
    levels: dict[int, dict[int, Bucket]] = {}
    for level in range(1, LEVELS + 1):
        parents: dict[int, Bucket] = {}
        for index in sorted(children):
            parent = parents.get(index // FACTOR)
            parents[index // FACTOR] = children[index] if parent is None else _merge(parent, children[index])
        levels[level] = children = parents
    return levels


def _backfill() -> None:
    """Buckets for the metrics already in the ledger, one series at a time."""
    connection = op.get_bind()
    m = _METRIC.c
    series = (m.job_id, m.name, m.attempt)
    for job_id, name, attempt in connection.execute(sa.select(*series).distinct()).all():
        raw = (
            sa.select(m.step, m.value)
            .where(m.job_id == job_id, m.name == name, m.attempt == attempt)
            .order_by(m.step, m.id)
        )
        points = [(int(step), float(value)) for step, value in connection.execute(raw)]
        rows = [
            {
                "job_id": job_id, "level": level, "name": name, "attempt": attempt, "bucket": index,
                "count": size, "first_step": first[0], "first_value": first[1], "last_step": last[0],
                "last_value": last[1], "min_step": low[0], "min_value": low[1], "max_step": high[0],
                "max_value": high[1],
            }
            for level, buckets in _series_buckets(points).items()
            for index, (size, first, last, low, high) in buckets.items()
        ]  # fmt: skip
        if rows:
            connection.execute(sa.insert(_ROLLUP), rows)


def downgrade() -> None:
    op.drop_index("ix_jobmetricrollup_bucket", table_name="jobmetricrollup")
    op.drop_table("jobmetricrollup")
    op.drop_index("ix_jobmetric_series", table_name="jobmetric")
    with op.batch_alter_table("job") as batch:
        batch.drop_column("expected_start_at")
