"""initial ledger

Revision ID: 0001
Revises: (none)
Create Date: 2026-12-02 16:28:37.617102
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:

    op.create_table(
        "job",
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("backend", sa.String(length=20), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("exit_code", sa.Integer(), nullable=True),
        sa.Column("external_id", sa.String(length=64), nullable=True),
        sa.Column("folder", sa.String(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
        sa.Column("progress", sa.JSON(), nullable=True),
        sa.Column("progress_offset", sa.Integer(), nullable=False),
        sa.Column("latest_checkpoint", sa.String(), nullable=True),
        sa.Column("cancel_requested", sa.Boolean(), nullable=False),
        sa.Column("claimed_by", sa.String(length=100), nullable=True),
        sa.Column("claimed_at", UTCDateTime(timezone=True), nullable=True),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("submitted_at", UTCDateTime(timezone=True), nullable=True),
        sa.Column("started_at", UTCDateTime(timezone=True), nullable=True),
        sa.Column("finished_at", UTCDateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_job_created_at"), ["created_at"], unique=False)
        batch_op.create_index(batch_op.f("ix_job_external_id"), ["external_id"], unique=False)
        batch_op.create_index(batch_op.f("ix_job_owner"), ["owner"], unique=False)
        batch_op.create_index("ix_job_owner_idempotency", ["owner", "idempotency_key"], unique=True)
        batch_op.create_index("ix_job_state_backend", ["state", "backend"], unique=False)
        batch_op.create_index("ix_job_updated_at_id", ["updated_at", "id"], unique=False)

    op.create_table(
        "jobevent",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("from_state", sa.String(length=20), nullable=True),
        sa.Column("to_state", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("time", UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["job.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("jobevent", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_jobevent_job_id"), ["job_id"], unique=False)

    op.create_table(
        "jobmetric",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("time", UTCDateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"],
            ["job.id"],
        ),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("jobmetric", schema=None) as batch_op:
        batch_op.create_index("ix_jobmetric_job_step", ["job_id", "step"], unique=False)


def downgrade() -> None:

    with op.batch_alter_table("jobmetric", schema=None) as batch_op:
        batch_op.drop_index("ix_jobmetric_job_step")

    op.drop_table("jobmetric")
    with op.batch_alter_table("jobevent", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobevent_job_id"))

    op.drop_table("jobevent")
    with op.batch_alter_table("job", schema=None) as batch_op:
        batch_op.drop_index("ix_job_updated_at_id")
        batch_op.drop_index("ix_job_state_backend")
        batch_op.drop_index("ix_job_owner_idempotency")
        batch_op.drop_index(batch_op.f("ix_job_owner"))
        batch_op.drop_index(batch_op.f("ix_job_external_id"))
        batch_op.drop_index(batch_op.f("ix_job_created_at"))

    op.drop_table("job")
