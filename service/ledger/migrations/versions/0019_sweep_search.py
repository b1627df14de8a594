"""a sweep's search: how many trials it makes in all (null for a grid), which the search loop
makes as earlier trials end

Revision ID: 0019
Revises: 0018
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sweep", sa.Column("search_trials", sa.Integer(), nullable=True))
    op.create_index("ix_sweep_search_trials", "sweep", ["search_trials"])


def downgrade() -> None:
    op.drop_index("ix_sweep_search_trials", table_name="sweep")
    op.drop_column("sweep", "search_trials")
