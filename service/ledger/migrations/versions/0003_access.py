"""access: API token hashes, the audit log and per-user quotas

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_job_owner_state", "job", ["owner", "state"])
    op.create_table(
        "apitoken",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("username", sa.String(length=100), nullable=False),
        sa.Column("admin", sa.Boolean(), nullable=False),
        sa.Column("token_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("token_hash"),
    )
    op.create_index("ix_apitoken_username", "apitoken", ["username"])
    op.create_table(
        "auditentry",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("time", UTCDateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=100), nullable=False),
        sa.Column("action", sa.String(length=40), nullable=False),
        sa.Column("target", sa.String(length=100), nullable=False),
        sa.Column("detail", sa.String(), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_auditentry_time", "auditentry", ["time"])
    op.create_index("ix_auditentry_actor", "auditentry", ["actor"])
    op.create_table(
        "userquota",
        sa.Column("username", sa.String(length=100), nullable=False),
        sa.Column("max_active_jobs", sa.Integer(), nullable=True),
        sa.Column("max_submissions_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_nodes", sa.Integer(), nullable=True),
        sa.Column("max_tasks", sa.Integer(), nullable=True),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.PrimaryKeyConstraint("username"),
    )


def downgrade() -> None:
    op.drop_table("userquota")
    op.drop_index("ix_auditentry_actor", "auditentry")
    op.drop_index("ix_auditentry_time", "auditentry")
    op.drop_table("auditentry")
    op.drop_index("ix_apitoken_username", "apitoken")
    op.drop_table("apitoken")
    op.drop_index("ix_job_owner_state", "job")
