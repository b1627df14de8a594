"""restarts in place: how many a job had, how far its restarts.jsonl is read, the restarts' records
(for its events and goodput) and its goodput as last worked out

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

from service.ledger import name_index

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_COUNTS = ("restart_count", "restarts_offset")
_RECORDS = ("restart_log", "goodput")


def upgrade() -> None:
    for name in _COUNTS:
        op.add_column("job", sa.Column(name, sa.Integer(), nullable=False, server_default="0"))
    for name in _RECORDS:
        op.add_column("job", sa.Column(name, sa.JSON(), nullable=True))


def downgrade() -> None:
    # On SQLite the batch rebuilds `job` by copy, which drops the name index's triggers: built again.
    dialect = op.get_bind().dialect.name
    for statement in name_index.drop_statements(dialect):
        op.execute(statement)
    with op.batch_alter_table("job") as batch:
        for column in (*_COUNTS, *_RECORDS):
            batch.drop_column(column)
    for statement in name_index.create_statements(dialect):
        op.execute(statement)
