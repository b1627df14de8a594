"""watchdog: a job's pace (when its last report was read, its reports' times) and its stall flag

Revision ID: 0013
Revises: 0012
"""

import sqlalchemy as sa
from alembic import op

from service.ledger import name_index
from service.ledger.models.columns import UTCDateTime

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_TIMES = ("progress_at", "stalled_at")


def upgrade() -> None:
    for name in _TIMES:
        op.add_column("job", sa.Column(name, UTCDateTime(timezone=True), nullable=True))
    op.add_column("job", sa.Column("report_times", sa.JSON(), nullable=True))
    op.add_column("job", sa.Column("stall_reason", sa.String(), nullable=True))


def downgrade() -> None:
    # On SQLite the batch rebuilds `job` by copy, which drops the name index's triggers: built again.
    dialect = op.get_bind().dialect.name
    for statement in name_index.drop_statements(dialect):
        op.execute(statement)
    with op.batch_alter_table("job") as batch:
        for column in (*_TIMES, "report_times", "stall_reason"):
            batch.drop_column(column)
    for statement in name_index.create_statements(dialect):
        op.execute(statement)
