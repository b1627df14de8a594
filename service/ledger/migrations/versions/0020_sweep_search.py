"""a sweep's search: how many trials it makes in all (null for a grid), which the search loop
makes as earlier trials end; a resumed trial's job: the pruned one it continues

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("sweep", sa.Column("search_trials", sa.Integer(), nullable=True))
    op.create_index("ix_sweep_search_trials", "sweep", ["search_trials"])
    # No foreign key: SQLite adds one only by rebuilding `job` (see 0018's downgrade)
    op.add_column("job", sa.Column("resumes", sa.Integer(), nullable=True))
    op.create_index("ix_job_resumes", "job", ["resumes"])


def downgrade() -> None:
    op.drop_index("ix_job_resumes", table_name="job")
    op.drop_column("job", "resumes")
    op.drop_index("ix_sweep_search_trials", table_name="sweep")
    op.drop_column("sweep", "search_trials")
