"""list indexes: jobs by a substring of their name, by state newest first (with or without the owner)

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

# The name index as this revision made it, frozen here: service.ledger.name_index holds the current
# one, and a later change to it is a revision of its own.
SQLITE_CREATE = (
    "CREATE VIRTUAL TABLE job_name_index USING fts5(name, content='job', content_rowid='id', "
    "tokenize='trigram')",
    "INSERT INTO job_name_index(job_name_index) VALUES ('rebuild')",
    "CREATE TRIGGER job_name_index_insert AFTER INSERT ON job BEGIN "
    "INSERT INTO job_name_index(rowid, name) VALUES (new.id, new.name); END",
    "CREATE TRIGGER job_name_index_delete AFTER DELETE ON job BEGIN "
    "INSERT INTO job_name_index(job_name_index, rowid, name) VALUES ('delete', old.id, old.name); END",
    "CREATE TRIGGER job_name_index_rename AFTER UPDATE OF name ON job BEGIN "
    "INSERT INTO job_name_index(job_name_index, rowid, name) VALUES ('delete', old.id, old.name); "
    "INSERT INTO job_name_index(rowid, name) VALUES (new.id, new.name); END",
)
SQLITE_DROP = (
    "DROP TRIGGER IF EXISTS job_name_index_rename",
    "DROP TRIGGER IF EXISTS job_name_index_delete",
    "DROP TRIGGER IF EXISTS job_name_index_insert",
    "DROP TABLE IF EXISTS job_name_index",
)
POSTGRES_CREATE = (
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    'CREATE INDEX IF NOT EXISTS ix_job_name_trgm ON job USING gin (name COLLATE "C" gin_trgm_ops)',
)
POSTGRES_DROP = ("DROP INDEX IF EXISTS ix_job_name_trgm",)


def upgrade() -> None:
    op.create_index("ix_job_state_id", "job", ["state", "id"])
    # (owner, state) gave SQLite the id order (its indexes end in the rowid), not PostgreSQL
    op.create_index("ix_job_owner_state_id", "job", ["owner", "state", "id"])
    op.drop_index("ix_job_owner_state", table_name="job")
    sqlite = op.get_bind().dialect.name == "sqlite"
    for statement in SQLITE_CREATE if sqlite else POSTGRES_CREATE:
        op.execute(statement)


def downgrade() -> None:
    sqlite = op.get_bind().dialect.name == "sqlite"
    for statement in SQLITE_DROP if sqlite else POSTGRES_DROP:
        op.execute(statement)
    op.create_index("ix_job_owner_state", "job", ["owner", "state"])
    op.drop_index("ix_job_owner_state_id", table_name="job")
    op.drop_index("ix_job_state_id", table_name="job")
