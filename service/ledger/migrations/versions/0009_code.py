"""code: uploaded code snapshots and who may run them

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "apitoken", sa.Column("allow_code", sa.Boolean(), nullable=False, server_default=sa.false())
    )
    op.add_column("userquota", sa.Column("allow_code", sa.Boolean(), nullable=True))
    op.create_table(
        "codesnapshot",
        sa.Column("digest", sa.String(length=64), primary_key=True),
        sa.Column("owner", sa.String(length=100), primary_key=True),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("files", sa.Integer(), nullable=False),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("codesnapshot")
    with op.batch_alter_table("userquota") as batch:
        batch.drop_column("allow_code")
    with op.batch_alter_table("apitoken") as batch:
        batch.drop_column("allow_code")
