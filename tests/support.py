"""Helpers shared by the test suite: strict mode, waiting, and a private PostgreSQL server."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from service.runtime import Runtime
from worker.spec import JobFiles, parse_placement

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def strict() -> bool:
    """In CI (CI=true) and under deploy/test.sh a missing dependency fails its tests instead of skipping."""
    return os.environ.get("CI", "").lower() == "true" or os.environ.get("TORCHYARD_TEST_STRICT") == "1"


def missing_dependency(reason: str) -> NoReturn:
    if strict():
        pytest.fail(f"{reason} (strict mode: CI=true or TORCHYARD_TEST_STRICT=1)", pytrace=False)
    pytest.skip(reason)


# A deadline for what the service does in well under a second when the machine is quiet. CI shares 2
# cores between the suite, its PostgreSQL and the service's threads: 10 s was once too short there
# (test_polling, test_cancel), and waiting longer costs a passing test nothing.
WAIT_S = 30.0
MOST_PAUSE_S = 0.05  # between looks, once the first few found nothing


def wait_for(probe: Callable[[], T | None], timeout: float = WAIT_S, what: str = "condition") -> T:
    """Poll `probe` until it returns something truthy; fail the test after `timeout` seconds.

    The pause between looks grows from 5 ms to MOST_PAUSE_S: a probe is often a request to the service
    in this process, and looking every 10 ms took the GIL from the very threads being waited for."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}; last value {value!r}")
        time.sleep(pause)
        pause = min(MOST_PAUSE_S, pause * 1.5)


class PostgresServer:
    """A private server for one test session, started and stopped by deploy/postgres/*.sh.

    `ledger_url` is one migrated database that `reset_ledger()` empties between tests (TRUNCATE, then
    the rows the migrations seeded put back): far quicker than a new database per test.
    """

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="torchyard-pg-")
        self.url = ""
        self.ledger_url = ""
        self._count = 0
        self._engine: sa.Engine | None = None
        self._tables: list[sa.Table] = []
        self._sequences: list[str] = []
        self._seed: dict[str, list[dict[str, Any]]] = {}

    def _env(self) -> dict[str, str]:
        return {**os.environ, "TORCHYARD_PG_DIR": self.dir, "TORCHYARD_PG_DB": "postgres"}

    def start(self) -> None:
        done = subprocess.run(
            ["bash", str(ROOT / "deploy/postgres/start.sh")],
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise RuntimeError(f"deploy/postgres/start.sh failed: {done.stderr.strip()[-1000:]}")
        self.url = done.stdout.strip().splitlines()[-1]

    def stop(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
        subprocess.run(["bash", str(ROOT / "deploy/postgres/stop.sh")], env=self._env(), timeout=60)

    def new_database(self) -> str:
        """Create an empty database with a fresh name; returns its URL."""
        self._count += 1
        name = f"t{os.getpid()}_{self._count}"
        self.execute(f'CREATE DATABASE "{name}"')
        return self.url.rsplit("/", 1)[0] + f"/{name}"

    def execute(self, statement: str) -> None:
        engine = sa.create_engine(self.url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
        try:
            with engine.connect() as connection:
                connection.execute(sa.text(statement))
        finally:
            engine.dispose()

    def prepare_ledger(self, migrate: Callable[[str], None]) -> None:
        """Create and migrate the shared ledger database; remember the rows the migrations seeded."""
        self.ledger_url = self.new_database()
        migrate(self.ledger_url)
        self._engine = engine = sa.create_engine(self.ledger_url, poolclass=sa.pool.NullPool)
        metadata = sa.MetaData()
        metadata.reflect(engine)
        # Children before parents, so that plain DELETEs respect the foreign keys.
        self._tables = [t for t in reversed(metadata.sorted_tables) if t.name != "alembic_version"]
        with engine.connect() as connection:
            for table in self._tables:
                rows = [dict(row._mapping) for row in connection.execute(table.select())]
                if rows:
                    self._seed[table.name] = rows
            self._sequences = list(
                connection.execute(
                    sa.text("SELECT sequence_name FROM information_schema.sequences")
                ).scalars()
            )

    def reset_ledger(self) -> str:
        """Empty every table of the shared ledger and put the seeded rows back; returns its URL.

        DELETE and a sequence restart, not TRUNCATE: on tables this small it is ten times quicker.
        """
        assert self._engine is not None, "prepare_ledger() first"
        with self._engine.begin() as connection:
            # A leftover connection inside a transaction would make this wait forever.
            connection.execute(sa.text("SET LOCAL lock_timeout = '10s'"))
            for table in self._tables:
                connection.execute(table.delete())
            for sequence in self._sequences:
                connection.execute(sa.text(f'ALTER SEQUENCE "{sequence}" RESTART'))
            for table in reversed(self._tables):
                if rows := self._seed.get(table.name):
                    connection.execute(table.insert(), rows)
        return self.ledger_url


def runtime_of(client: TestClient) -> Runtime:
    """The running service behind a TestClient: its engine, loops and backends."""
    runtime: Runtime = client.app.state.runtime  # type: ignore[attr-defined]
    return runtime


JOBS = "/api/v1/jobs"


def submit(client: TestClient, **fields: Any) -> dict[str, Any]:
    """POST a small valid job (override any field); returns the created job."""
    body: dict[str, Any] = {"name": "job", "entrypoint": "worker.tasks.seed:ddp_step", **fields}
    response = client.post(JOBS, json=body)
    assert response.status_code == 201, response.text
    job: dict[str, Any] = response.json()
    return job


def get_job(client: TestClient, job_id: int, headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = client.get(f"{JOBS}/{job_id}", headers=headers)
    assert response.status_code == 200, response.text
    job: dict[str, Any] = response.json()
    return job


def wait_state(
    client: TestClient,
    job_id: int,
    state: str,
    timeout: float = WAIT_S,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Wait until the ledger shows the job in `state` (the service's loops move it)."""

    def probe() -> dict[str, Any] | None:
        job = get_job(client, job_id, headers)
        return job if job["state"] == state else None

    return wait_for(probe, timeout, f"job {job_id} to be {state}")


def issue_token(
    engine: sa.Engine, user: str, admin: bool = False, unix_user: str | None = None, allow_code: bool = False
) -> str:
    """A real API token for `user`, made as `torchyard token create` makes one."""
    from service.domain import auth
    from service.ledger.db import session_scope

    with session_scope(engine) as session:
        return auth.create_token(
            session, user, admin=admin, unix_user=unix_user, allow_code=allow_code, actor="test"
        )


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def login_headers(app: Any, user: str = "alice", admin: bool = False) -> dict[str, str]:
    """Headers with a fresh token for `user` on a started app (its lifespan has built the runtime)."""
    runtime: Runtime = app.state.runtime
    return bearer(issue_token(runtime.engine, user, admin=admin))


def authorize(client: TestClient, user: str = "alice", admin: bool = False) -> TestClient:
    """Make every request of this entered TestClient carry a token for `user`."""
    client.headers.update(login_headers(client.app, user, admin))
    return client


def rank_pid(job: dict[str, Any], rank: int) -> int:
    """The process of `rank` of this attempt of `job`, as its placement file names it: every run of
    a rank writes one when it starts (a run restarted in place, its own), whether the supervisor
    started the rank cold or forked it from the job's warm parent."""
    path = JobFiles(Path(job["folder"])).placement(rank)
    try:
        placed = parse_placement(path.read_text(), job["attempt"])
    except OSError as error:
        raise AssertionError(f"rank {rank} of job {job['id']} has no placement: {error!r}") from None
    if placed is None or placed.pid is None or not Path(f"/proc/{placed.pid}").exists():
        raise AssertionError(f"rank {rank} of job {job['id']} has no process running: {placed}")
    return placed.pid


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    """asyncio.run in a thread of its own: the test process may already run a loop (Playwright's,
    for the browser tests of the same session)."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result(timeout=120)
