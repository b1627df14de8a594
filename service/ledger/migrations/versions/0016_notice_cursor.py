"""notice cursor: how far a notice's fan-out has come (the last subscription id looked at), and the
index the round-robin claim of deliveries reads (each owner's next due ones)

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("notice", sa.Column("fanned_to", sa.Integer(), nullable=True))
    op.create_index("ix_delivery_owner_status_next_at", "delivery", ["owner", "status", "next_at"])


def downgrade() -> None:
    op.drop_index("ix_delivery_owner_status_next_at", table_name="delivery")
    with op.batch_alter_table("notice") as batch:
        batch.drop_column("fanned_to")
