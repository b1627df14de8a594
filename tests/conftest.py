"""Shared fixtures for the whole suite.

- `postgres_server` (session): a private PostgreSQL 15 server started by deploy/postgres/start.sh in a
  temp folder, stopped at the end. Tests share one migrated database, emptied before each test
  (tests.support.PostgresServer.reset_ledger: quicker than a new database per test).
- `database_url`: every test that asks for it runs twice, on a fresh SQLite file (a copy of one
  migrated once a session, `sqlite_template`) and on the emptied PostgreSQL ledger (that run carries
  the `postgres` marker).
- `slapd_server` (session): a private OpenLDAP server (tests.slapd) with alice, bob and a group that
  makes an admin, for the LDAP sign-in.
- `settings`: Settings with data_dir under tmp_path, that database and short loop intervals; every
  job runs as the account the tests run as.
- `fake` / `fake_slurm`: tests.fakes.FakeBackend instances standing in for the local and SLURM backends.
- `api`: a TestClient on create_app(settings, backends={"local": fake, "slurm": fake_slurm}), entered as
  a context manager so the lifespan (migrations, intake, dispatch and reconcile loops) runs. It sends a
  real token of the ordinary user `alice`; `login(user, admin=False)` gives headers for anyone else.

Missing dependencies: tests that need PostgreSQL, SLURM (marker `slurm`) or Chromium (marker `browser`)
are skipped when it is missing, and FAIL instead in strict mode (CI=true, or TORCHYARD_TEST_STRICT=1 as
deploy/test.sh sets). deploy/test.sh tells the suite how SLURM came up in TORCHYARD_TEST_SLURM.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine

from service.app import create_app
from service.config import Settings
from service.ledger.db import make_engine, migrate
from service.states import JobState
from tests.fakes import FakeBackend
from tests.slapd import SlapdServer
from tests.slapd import missing as slapd_missing
from tests.support import PostgresServer, bearer, issue_token, missing_dependency

# ---------------------------------------------------------------- real dependencies


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer()
    try:
        server.start()
        server.prepare_ledger(_migrate)
    except Exception as error:
        server.stop()
        missing_dependency(f"PostgreSQL could not start: {error}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def slapd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlapdServer]:
    """A private OpenLDAP server with alice, bob and an admin group (tests.slapd)."""
    if problem := slapd_missing():
        missing_dependency(problem)
    server = SlapdServer(tmp_path_factory.mktemp("slapd"))
    try:
        server.start()
    except Exception as error:
        server.stop()
        missing_dependency(f"slapd could not start: {error}")
    yield server
    server.stop()


def _migrate(url: str) -> None:
    engine = make_engine(url)
    try:
        migrate(engine)
    finally:
        engine.dispose()


@cache
def _slurm_problem() -> str | None:
    """Why SLURM is unusable, or None. deploy/test.sh reports how deploy/slurm/up.sh went."""
    reported = os.environ.get("TORCHYARD_TEST_SLURM")
    if reported is not None:
        return None if reported == "up" else f"SLURM cluster not available: {reported}"
    if shutil.which("sinfo") is None:
        return "SLURM is not installed (run deploy/slurm/up.sh)"
    probe = subprocess.run(["sinfo", "-h"], capture_output=True, text=True, timeout=15)
    return None if probe.returncode == 0 else f"SLURM controller not answering: {probe.stderr.strip()}"


@cache
def _browser_problem() -> str | None:
    if not Path("/usr/bin/chromium").exists():
        return "no Chromium at /usr/bin/chromium (apt-get install chromium)"
    try:
        import playwright  # noqa: F401
    except ImportError:
        return "the playwright package is not installed"
    return None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("slurm") is not None and (problem := _slurm_problem()):
        missing_dependency(problem)
    if item.get_closest_marker("browser") is not None and (problem := _browser_problem()):
        missing_dependency(problem)


# ---------------------------------------------------------------- the ledger and settings


@pytest.fixture(scope="session")
def sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite ledger migrated once a session. Migrating a new file takes ~0.5 s (15 revisions), and
    some 560 tests start from an empty SQLite ledger: each gets a copy of this one instead (the
    service's own migrate() then finds it at head, as after any restart)."""
    template = tmp_path_factory.mktemp("sqlite-template") / "ledger.db"
    _migrate(f"sqlite:///{template}")  # its engine disposed: the last close folds the WAL in
    assert not template.with_name("ledger.db-wal").exists(), "the template's WAL was left unfolded"
    return template


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        ledger = tmp_path / "ledger.db"
        shutil.copyfile(request.getfixturevalue("sqlite_template"), ledger)
        return f"sqlite:///{ledger}"
    server: PostgresServer = request.getfixturevalue("postgres_server")
    return server.reset_ledger()


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    """An engine on a migrated, empty ledger, on each database the suite runs."""
    made = make_engine(settings.database_url)
    migrate(made)
    yield made
    made.dispose()


@pytest.fixture
def settings(database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    for name in list(os.environ):  # a developer's TORCHYARD_* must not leak into the tests
        if name.startswith("TORCHYARD_") and not name.startswith("TORCHYARD_TEST_"):
            monkeypatch.delenv(name)
    return Settings(
        database_url=database_url,
        data_dir=tmp_path / "data",
        default_backend="local",
        reconcile_interval_s=0.05,
        local_reconcile_interval_s=0.05,
        ending_files_grace_s=0.2,  # a few ticks: short, so that endings without files are not waited on
        dispatch_interval_s=0.05,
        max_nodes=4,
        max_tasks_per_node=8,
        max_gpus_per_node=2,
        allowed_script_dirs=[str(tmp_path)],
        # The suite runs as root, where "owner" would start each user's jobs as the Unix account of
        # that name; tests/integration/test_isolation*.py test that, with accounts made for it.
        job_accounts="service",
    )


# ---------------------------------------------------------------- fake backends and the API


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend("local")


@pytest.fixture
def fake_slurm() -> FakeBackend:
    return FakeBackend("slurm", default=JobState.pending)


@pytest.fixture
def api(settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend) -> Iterator[TestClient]:
    app = create_app(settings, backends={"local": fake, "slurm": fake_slurm})
    with TestClient(app) as client:
        client.headers.update(bearer(issue_token(app.state.runtime.engine, "alice")))
        yield client


Login = Callable[..., dict[str, str]]


@pytest.fixture
def login(api: TestClient) -> Login:
    """login("bob") or login("root", admin=True): headers carrying a fresh token for that user."""
    engine = api.app.state.runtime.engine  # type: ignore[attr-defined]

    def headers(user: str, admin: bool = False) -> dict[str, str]:
        return bearer(issue_token(engine, user, admin=admin))

    return headers
