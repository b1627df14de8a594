"""restarts in place: how many a job had, how far its restarts.jsonl is read, the restarts' records
(for its events and goodput) and its goodput as last worked out

Revision ID: 0018
Revises: 0017
"""

import sqlalchemy as sa
from alembic import op

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
    # In place (SQLite drops a plain column itself): a batch would rebuild `job` by copy, making the
    # inline foreign keys of 0006 and 0014 table constraints that their own downgrades cannot drop.
    for column in (*_COUNTS, *_RECORDS):
        op.drop_column("job", column)
