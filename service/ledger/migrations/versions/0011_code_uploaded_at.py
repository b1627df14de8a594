"""code: when each user last uploaded a snapshot (collection keeps it that long after)

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("codesnapshot") as batch:
        batch.add_column(sa.Column("uploaded_at", UTCDateTime(timezone=True), nullable=True))
    op.execute("UPDATE codesnapshot SET uploaded_at = created_at")
    with op.batch_alter_table("codesnapshot") as batch:
        batch.alter_column("uploaded_at", existing_type=UTCDateTime(timezone=True), nullable=False)


def downgrade() -> None:
    with op.batch_alter_table("codesnapshot") as batch:
        batch.drop_column("uploaded_at")
