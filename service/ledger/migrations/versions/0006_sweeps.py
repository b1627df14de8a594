"""sweeps: one request's grid of trials; each trial is a job carrying its sweep and parameters

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sweep",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("backend", sa.String(length=20), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("size", sa.Integer(), nullable=False),
        sa.Column("max_parallel", sa.Integer(), nullable=True),
        sa.Column("metric", sa.String(length=100), nullable=False),
        sa.Column("goal", sa.String(length=3), nullable=False),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_sweep_owner", "sweep", ["owner"])
    op.create_index("ix_sweep_owner_idempotency", "sweep", ["owner", "idempotency_key"], unique=True)
    if op.get_bind().dialect.name == "sqlite":
        # The foreign key inline, added in place: alembic would rebuild the table for it, which the
        # foreign keys of jobevent and jobmetric refuse on a ledger that holds jobs.
        op.execute("ALTER TABLE job ADD COLUMN sweep_id INTEGER REFERENCES sweep (id)")
    else:
        op.add_column("job", sa.Column("sweep_id", sa.Integer(), nullable=True))
        op.create_foreign_key("fk_job_sweep_id_sweep", "job", "sweep", ["sweep_id"], ["id"])
    op.add_column("job", sa.Column("params", sa.JSON(), nullable=True))
    op.create_index("ix_job_sweep_id", "job", ["sweep_id"])


def downgrade() -> None:
    op.drop_index("ix_job_sweep_id", table_name="job")
    op.drop_column("job", "params")
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_job_sweep_id_sweep", "job", type_="foreignkey")
    op.drop_column("job", "sweep_id")  # SQLite drops a column with its inline foreign key
    op.drop_index("ix_sweep_owner_idempotency", table_name="sweep")
    op.drop_index("ix_sweep_owner", table_name="sweep")
    op.drop_table("sweep")
