"""retention: each job folder's measured size and what retention removed of it; a per-user keep time

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_TIMES = ("folder_measured_at", "files_removed_at", "folder_removed_at")


def upgrade() -> None:
    op.add_column("job", sa.Column("folder_bytes", sa.BigInteger(), nullable=True))
    for name in _TIMES:
        op.add_column("job", sa.Column(name, UTCDateTime(timezone=True), nullable=True))
    op.create_index("ix_job_folder_removed_finished", "job", ["folder_removed_at", "finished_at"])
    op.create_index("ix_job_folder_bytes", "job", ["folder_bytes"])
    op.add_column("userquota", sa.Column("keep_finished_days", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("userquota") as batch:
        batch.drop_column("keep_finished_days")
    op.drop_index("ix_job_folder_bytes", table_name="job")
    op.drop_index("ix_job_folder_removed_finished", table_name="job")
    with op.batch_alter_table("job") as batch:
        for column in ("folder_bytes", *_TIMES):
            batch.drop_column(column)
