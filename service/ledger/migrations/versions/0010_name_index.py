"""name index: find jobs by a substring of their name, and by state newest first, without a full scan

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
    for statement in name_index.create_statements(op.get_bind().dialect.name):
        op.execute(statement)


def downgrade() -> None:
    for statement in name_index.drop_statements(op.get_bind().dialect.name):
        op.execute(statement)
    op.drop_index("ix_job_state_id", table_name="job")
