"""notifications: webhook subscriptions, the outbox of states to tell (notice), deliveries

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "subscription",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("secret", sa.String(length=200), nullable=False),
        sa.Column("on", sa.JSON(), nullable=False),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("job.id"), nullable=True),
        sa.Column("pipeline_id", sa.Integer(), sa.ForeignKey("pipeline.id"), nullable=True),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_subscription_owner", "subscription", ["owner"])
    op.create_index("ix_subscription_job_id", "subscription", ["job_id"])
    op.create_index("ix_subscription_pipeline_id", "subscription", ["pipeline_id"])
    op.create_table(
        "notice",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("pipeline_id", sa.Integer(), nullable=True),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("time", UTCDateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "delivery",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("delivery_id", sa.String(length=36), nullable=False, unique=True),
        sa.Column("subscription_id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("pipeline_id", sa.Integer(), nullable=True),
        sa.Column("event", sa.String(length=40), nullable=False),
        sa.Column("payload", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(length=10), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("next_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("last_error", sa.String(), nullable=True),
        sa.Column("last_status", sa.Integer(), nullable=True),
        sa.Column("claimed_by", sa.String(length=100), nullable=True),
        sa.Column("claimed_until", UTCDateTime(timezone=True), nullable=True),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("delivered_at", UTCDateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_delivery_subscription_id", "delivery", ["subscription_id"])
    op.create_index("ix_delivery_job_id", "delivery", ["job_id"])
    op.create_index("ix_delivery_pipeline_id", "delivery", ["pipeline_id"])
    op.create_index("ix_delivery_status_next_at", "delivery", ["status", "next_at"])
    op.create_index("ix_delivery_owner_id", "delivery", ["owner", "id"])


def downgrade() -> None:
    op.drop_table("delivery")
    op.drop_table("notice")
    op.drop_table("subscription")
