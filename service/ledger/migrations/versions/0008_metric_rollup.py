"""metric rollup (every metric series in buckets of 8**k steps, so long runs stay viewable) and the
scheduler's start estimate of a waiting job

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models import UTCDateTime

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


def _backfill() -> None:
    """Buckets for the metrics already in the ledger, through the same code that keeps them."""
    from service.domain.metric_series import SeriesKey, refresh

    connection = op.get_bind()
    metric = sa.table(
        "jobmetric", sa.column("job_id"), sa.column("name"), sa.column("attempt"), sa.column("step")
    )
    series = (metric.c.job_id, metric.c.name, metric.c.attempt)
    spans = sa.select(*series, sa.func.min(metric.c.step), sa.func.max(metric.c.step)).group_by(*series)
    for job_id, name, attempt, first, last in connection.execute(spans).all():
        refresh(connection, SeriesKey(job_id, name, attempt), first, last)


def downgrade() -> None:
    op.drop_index("ix_jobmetricrollup_bucket", table_name="jobmetricrollup")
    op.drop_table("jobmetricrollup")
    op.drop_index("ix_jobmetric_series", table_name="jobmetric")
    with op.batch_alter_table("job") as batch:
        batch.drop_column("expected_start_at")
