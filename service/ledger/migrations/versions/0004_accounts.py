"""accounts: the Unix account each job runs as, and the one a token maps its user to

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("job", sa.Column("run_as", sa.String(length=64), nullable=True))
    op.add_column("apitoken", sa.Column("unix_user", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("apitoken") as batch:
        batch.drop_column("unix_user")
    with op.batch_alter_table("job") as batch:
        batch.drop_column("run_as")
