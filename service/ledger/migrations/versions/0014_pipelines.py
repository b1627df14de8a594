"""pipelines: dependencies between jobs, pipelines and their stages, a job's pipeline and stage

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

from service.ledger.models.columns import UTCDateTime

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "pipeline",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("owner", sa.String(length=200), nullable=False),
        sa.Column("request", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(length=20), nullable=False),
        sa.Column("reason", sa.String(), nullable=True),
        sa.Column("idempotency_key", sa.String(length=200), nullable=True),
        sa.Column("created_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("updated_at", UTCDateTime(timezone=True), nullable=False),
        sa.Column("finished_at", UTCDateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_pipeline_owner", "pipeline", ["owner"])
    op.create_index("ix_pipeline_owner_idempotency", "pipeline", ["owner", "idempotency_key"], unique=True)
    op.create_table(
        "pipelinestage",
        sa.Column("pipeline_id", sa.Integer(), sa.ForeignKey("pipeline.id"), primary_key=True),
        sa.Column("name", sa.String(length=100), primary_key=True),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("after", sa.JSON(), nullable=False),
        sa.Column("on", sa.String(length=10), nullable=False),
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("job.id"), nullable=True),
        sa.Column("sweep_id", sa.Integer(), sa.ForeignKey("sweep.id"), nullable=True),
        sa.Column("runs", sa.Integer(), nullable=False),
    )
    op.create_table(
        "jobdependency",
        sa.Column("job_id", sa.Integer(), sa.ForeignKey("job.id"), primary_key=True),
        sa.Column("upstream_id", sa.Integer(), sa.ForeignKey("job.id"), primary_key=True),
        sa.Column("on", sa.String(length=10), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
    )
    op.create_index("ix_jobdependency_upstream", "jobdependency", ["upstream_id"])
    if op.get_bind().dialect.name == "sqlite":  # inline, in place: as 0006 adds sweep_id
        op.execute("ALTER TABLE job ADD COLUMN pipeline_id INTEGER REFERENCES pipeline (id)")
    else:
        op.add_column("job", sa.Column("pipeline_id", sa.Integer(), nullable=True))
        op.create_foreign_key("fk_job_pipeline_id_pipeline", "job", "pipeline", ["pipeline_id"], ["id"])
    op.add_column("job", sa.Column("stage", sa.String(length=100), nullable=True))
    op.create_index("ix_job_pipeline_id", "job", ["pipeline_id"])


def downgrade() -> None:
    op.drop_index("ix_job_pipeline_id", table_name="job")
    op.drop_column("job", "stage")
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_job_pipeline_id_pipeline", "job", type_="foreignkey")
    op.drop_column("job", "pipeline_id")  # SQLite drops a column with its inline foreign key
    op.drop_index("ix_jobdependency_upstream", table_name="jobdependency")
    op.drop_table("jobdependency")
    op.drop_table("pipelinestage")
    op.drop_index("ix_pipeline_owner_idempotency", table_name="pipeline")
    op.drop_index("ix_pipeline_owner", table_name="pipeline")
    op.drop_table("pipeline")
