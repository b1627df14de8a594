"""code snapshots: the bytes their files take unpacked, which count against their owner's limit

Revision ID: 0017
Revises: 0016
"""

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("codesnapshot") as batch:
        batch.add_column(sa.Column("unpacked_bytes", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("codesnapshot") as batch:
        batch.drop_column("unpacked_bytes")
