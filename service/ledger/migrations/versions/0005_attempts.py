"""attempts: each job's retry policy, where its attempt runs (hosts, ranks), and how every attempt ended

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("run_attempt", sa.Integer(), nullable=True))
    op.add_column("job", sa.Column("retries", sa.JSON(), nullable=True))
    op.add_column("job", sa.Column("retry_at", UTCDateTime(timezone=True), nullable=True))
    op.add_column("job", sa.Column("nodes", sa.String(), nullable=True))
    op.add_column("job", sa.Column("placement", sa.JSON(), nullable=True))
    op.add_column("job", sa.Column("attempt_started_at", UTCDateTime(timezone=True), nullable=True))
    op.create_table(
        "jobattempt",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("job.id"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("kind", sa.String(length=20), nullable=True),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("external_id", sa.String(length=64), nullable=True),
        sa.Column("nodes", sa.String(), nullable=True),
        sa.Column("placement", sa.JSON(), nullable=True),
        sa.Column("started_at", UTCDateTime(timezone=True), nullable=True),
        sa.Column("ended_at", UTCDateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_jobattempt_job_attempt", "jobattempt", ["job_id", "attempt"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_jobattempt_job_attempt", table_name="jobattempt")
    op.drop_table("jobattempt")
    with op.batch_alter_table("job") as batch:
        for column in ("attempt_started_at", "placement", "nodes", "retry_at", "retries", "run_attempt"):
            batch.drop_column(column)
