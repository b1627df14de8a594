"""ledger clock: one row bumped at commit by every change to a job (cheap ETags, safe `since`)

Revision ID: 0002
Revises: 0001
"""

from datetime import datetime, timezone

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    clock = op.create_table(
        "ledgerclock",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("stamped_at", UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.bulk_insert(clock, [{"id": 1, "seq": 0, "stamped_at": datetime.now(timezone.utc)}])


def downgrade() -> None:
    op.drop_table("ledgerclock")
