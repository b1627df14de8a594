"""list indexes: jobs by a substring of their name, by state newest first (with or without the owner)

Revision ID: 0010
Revises: 0009
"""

from alembic import op

from service.ledger import name_index

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_job_state_id", "job", ["state", "id"])
    # (owner, state) gave SQLite the id order (its indexes end in the rowid), not PostgreSQL
    op.create_index("ix_job_owner_state_id", "job", ["owner", "state", "id"])
    op.drop_index("ix_job_owner_state", table_name="job")
    for statement in name_index.create_statements(op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    for statement in name_index.drop_statements(op.get_bind().dialect.name):
        op.execute(statement)
    op.create_index("ix_job_owner_state", "job", ["owner", "state"])
    op.drop_index("ix_job_owner_state_id", table_name="job")
    op.drop_index("ix_job_state_id", table_name="job")
