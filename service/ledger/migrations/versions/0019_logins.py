"""logins: a token's expiry and how it was made, and the MUNGE credentials already used

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("apitoken", sa.Column("expires_at", UTCDateTime(timezone=True), nullable=True))
    op.add_column("apitoken", sa.Column("via", sa.String(length=16), nullable=True))
    op.create_table(
        "usedcredential",
        sa.Column("nonce", sa.String(length=64), nullable=False),
        sa.Column("uid", sa.Integer(), nullable=False),
        sa.Column("expires_at", UTCDateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("nonce"),
    )
    op.create_index("ix_usedcredential_expires_at", "usedcredential", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_usedcredential_expires_at", "usedcredential")
    op.drop_table("usedcredential")
    op.drop_column("apitoken", "via")
    op.drop_column("apitoken", "expires_at")
