"""Ledger tables and their API model families (JobCreate -> Job -> JobPublic ...), a module per concept:
- columns.py: UTCDateTime, utcnow, the timestamp column every table uses;
- jobs.py: the Job table, JobCreate, NewJob, JobPublic, JobPage, the retry policy, a job's folder and
  checkpoints as readers see them;
- sweeps.py: SweepCreate (its job a JobTemplate), the Sweep table, NewSweep, the public sweep and trials;
- history.py: the ledger clock, each state change (JobEvent) and how each attempt ended (JobAttempt);
- metrics.py: reported values (JobMetric), their rollup (JobMetricRollup), the series readers get;
- access.py: API tokens, the MUNGE credentials used to log in, the audit log, per-user quotas;
- code_snapshots.py: each user's claim on a stored code snapshot, and the answers to an upload;
- pipelines.py: dependencies between jobs, pipelines and their stages;
- notifications.py: webhook subscriptions, the outbox of states to tell (Notice), deliveries;
- stacks.py: the last capture of every rank's stacks, per job and attempt.

Each table registers itself on SQLModel.metadata when its module is imported. Importing any of these
modules runs this one first, which imports them all: Alembic (migrations/env.py), the comparison of
the migrated schema with the models (tests/api/test_migrations.py) and the foreign keys between tables
always see every table, whichever module a caller imported. Import the names from their modules.
"""

from service.ledger.models import (  # noqa: F401  (registers every table)
    access,
    code_snapshots,
    columns,
    history,
    jobs,
    metrics,
    notifications,
    pipelines,
    stacks,
    sweeps,
)
