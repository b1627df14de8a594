"""stack captures: the last capture of every rank's stacks, per job and attempt

Revision ID: 0012
Revises: 0011
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stackcapture",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("job.id"), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("captured_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("trigger", sa.String(length=20), nullable=False),
        sa.Column("took_s", sa.Float(), nullable=False),
        sa.Column("summary", sa.String(), nullable=False),
        sa.Column("ranks", sa.JSON(), nullable=False),
        sa.Column("groups", sa.JSON(), nullable=False),
    )
    op.create_index("ix_stackcapture_job_attempt", "stackcapture", ["job_id", "attempt"], unique=True)


def downgrade() -> None:
    op.drop_index("ix_stackcapture_job_attempt", table_name="stackcapture")
    op.drop_table("stackcapture")
