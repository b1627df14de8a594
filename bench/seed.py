"""A ledger of many jobs for the benchmarks, written in bulk (the API would take hours for 10^6).

Names follow NAMES: half the jobs are `train-resnet-<number>`, half `eval-bert-<number>`, the number
the job id, zero-padded to 7 digits, so a bench can ask for a substring every other job holds and one
a single job holds. The name index is dropped before the rows go in and built again after, by the
statements the migration runs (an index built once is faster than one kept up 10^6 times).
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import insert, text
from sqlalchemy.engine import Connection

from service.ledger import name_index
from service.ledger.db import is_sqlite, make_engine, migrate
from service.ledger.models.columns import utcnow
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job

BATCH = 20_000
NAMES = ("train-resnet", "eval-bert")
SPEC = {"entrypoint": "worker.tasks.train:train", "resources": {"nodes": 1, "tasks_per_node": 2}}
PROGRESS = {"step": 100, "total": 100, "metrics": {"loss": 0.1}}


def job_name(job_id: int) -> str:
    return f"{NAMES[job_id % 2]}-{job_id:07d}"


def sqlite_url(data_dir: Path) -> str:
    """The ledger the service makes in `data_dir` when no database URL is set."""
    return f"sqlite:///{(data_dir / 'torchyard.db').resolve()}"


def seed_jobs(database_url: str, data_dir: Path, count: int, running: int = 0) -> None:
    """`count` finished jobs on an empty ledger (SQLite or PostgreSQL), ids 1..count; the newest
    `running` of them are running instead, with progress to be moved on."""
    engine = make_engine(database_url)
    migrate(engine)
    dialect = engine.dialect.name
    with engine.begin() as connection:
        for statement in name_index.drop_statements(dialect):
            connection.execute(text(statement))
    for start in range(1, count + 1, BATCH):
        with engine.begin() as connection:
            rows = _rows(data_dir, start, min(start + BATCH, count + 1), count - running)
            if is_sqlite(database_url):
                connection.execute(insert(Job), list(rows))
            else:
                _copy(connection, rows)
    with engine.begin() as connection:
        now = utcnow()
        connection.execute(insert(JobEvent), [{"job_id": 1, "to_state": "queued", "attempt": 1, "time": now}])
        for statement in name_index.create_statements(dialect):
            connection.execute(text(statement))
        if not is_sqlite(database_url):  # the sequence COPY did not move
            connection.execute(text("SELECT setval('job_id_seq', :count)"), {"count": max(count, 1)})
    name_index.merge_segments(engine)  # as the service's first housekeeping pass leaves it
    if not is_sqlite(database_url):
        # What a ledger that grew over months has had, and autovacuum would otherwise do during the
        # measurement: statistics, hint bits and the visibility map set, the load's pages written
        # out. Measured without it, reads stalled for ~2 s (p99) while autovacuum and a checkpoint
        # wrote a freshly loaded 10^6 jobs.
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
            connection.execute(text("VACUUM (ANALYZE) job"))
            connection.execute(text("CHECKPOINT"))
    engine.dispose()


def _rows(data_dir: Path, start: int, stop: int, last_finished: int) -> Iterator[dict[str, Any]]:
    now = utcnow()
    for i in range(start, stop):
        finished = i <= last_finished
        yield {
            "id": i,
            "name": job_name(i),
            "owner": "bench",
            "backend": "slurm",
            "state": "succeeded" if finished else "running",
            "spec": SPEC,
            "attempt": 1,
            "progress_offset": 0,
            "cancel_requested": False,
            "folder": str(data_dir / "jobs" / str(i)),
            "result": {"ok": True},
            "progress": PROGRESS,
            # A ledger's finished jobs have had their folders measured (service.domain.retention):
            # unmeasured, housekeeping would measure and restamp 200 of them every 10 s meanwhile.
            "folder_bytes": 0 if finished else None,
            "folder_measured_at": now if finished else None,
            "created_at": now,
            "updated_at": now,
        }


def _copy(connection: Connection, rows: Iterator[dict[str, Any]]) -> None:
    """PostgreSQL's COPY: an order of magnitude faster than INSERTs of the same rows."""
    columns = ("id", "name", "owner", "backend", "state", "spec", "attempt", "progress_offset",
               "cancel_requested", "folder", "result", "progress", "folder_bytes", "folder_measured_at",
               "created_at", "updated_at")  # fmt: skip
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    for row in rows:
        writer.writerow(
            json.dumps(row[c])
            if isinstance(row[c], dict)
            else row[c].isoformat()
            if c.endswith("_at") and row[c] is not None
            else row[c]
            for c in columns
        )
    buffer.seek(0)
    cursor = connection.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    cursor.copy_expert(f"COPY job ({', '.join(columns)}) FROM STDIN WITH (FORMAT csv)", buffer)
