"""The ledger's engine, sessions and migrations (Alembic, applied on start)."""

from __future__ import annotations

import sqlite3
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlmodel import Session, create_engine

from service.ledger import clock as ledger_clock

MIGRATIONS_DIR = Path(__file__).parent / "migrations"


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


POSTGRES_CONNECT_TIMEOUT_S = 5


def make_engine(url: str) -> Engine:
    """An engine tuned for the ledger: WAL SQLite for one machine, pooled PostgreSQL for production."""
    ledger_clock.install()  # every session stamps the jobs it changes at commit
    if is_sqlite(url):
        _ensure_sqlite_folder(url)
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    parsed = make_url(url)
    if parsed.drivername == "postgresql":  # SQLAlchemy 2.1 would pick psycopg 3, which is not installed
        parsed = parsed.set(drivername="postgresql+psycopg2")
    # connect_timeout: an unreachable database host must be a prompt 503, not the OS's TCP timeout
    connect_args = {"connect_timeout": POSTGRES_CONNECT_TIMEOUT_S} if url.startswith("postgresql") else {}
    return create_engine(parsed, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args=connect_args)


def _ensure_sqlite_folder(url: str) -> None:
    """The SQLite file's folder, and the file itself, readable and writable by the service alone.

    SQLite makes its -wal and -shm files with the database file's mode, so 0600 covers them too.
    """
    path = url.split("///", 1)[-1]
    if path and path != ":memory:" and not path.startswith("file:"):
        database = Path(path)
        database.parent.mkdir(parents=True, exist_ok=True)
        database.touch(mode=0o600)
        database.chmod(0o600)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers run beside the single writer. NORMAL: a commit does not wait for the disk, so
    # the file is never corrupted and a process crash loses nothing, but a power cut or an OS crash
    # can undo the last commits, for a commit many times cheaper than FULL's (docs/performance.md,
    # Figures behind the design); docs/operations.md says so, and production ledgers are PostgreSQL.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def check_ledger(engine: Engine) -> None:
    """Raise unless the ledger answers a read of its tables from what it holds now.

    `SELECT 1` is answered without reading the file, so it said ok for a ledger that was truncated or
    overwritten; so do a pooled SQLite connection's cached pages, which SQLite in WAL mode trusts until
    the WAL changes. A SQLite ledger is therefore read through a fresh connection of its own (SQLite
    shares the file's locks between connections of one process, where a plain open() and close() of
    the file would drop them all).
    """
    database = engine.url.database
    if is_sqlite(str(engine.url)) and database and database != ":memory:":
        fresh = sqlite3.connect(database, timeout=5)
        try:
            _read_ledger(fresh.execute)
        finally:
            fresh.close()
        return
    with engine.connect() as connection:
        _read_ledger(connection.exec_driver_sql)


def _read_ledger(execute: Callable[[str], Any]) -> None:
    if execute("SELECT seq FROM ledgerclock WHERE id = 1").fetchone() is None:
        raise RuntimeError("the ledger has no clock row")
    execute("SELECT id FROM job ORDER BY id DESC LIMIT 1").fetchone()


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.attributes["engine"] = engine
    return config


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (idempotent; safe with several replicas on PostgreSQL)."""
    command.upgrade(alembic_config(engine), "head")


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One transaction: commit on success, roll back on error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


class TurnLock:
    """A lock taken in the order it was asked for. threading.Lock lets the thread that releases it
    take it again before a waiter wakes, so a writer in a loop (a fan-out's chunks, a burst of
    commits) could keep another user's write waiting for the whole loop: here each waits at most
    for the writers that asked before it."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._next_ticket = 0
        self._serving = 0
        self._left: set[int] = set()  # tickets whose waiter gave up (an exception while it waited)

    def __enter__(self) -> None:
        with self._changed:
            ticket = self._next_ticket
            self._next_ticket += 1
            try:
                while ticket != self._serving:
                    self._changed.wait()
            except BaseException:  # given up: its turn is passed on, or the turns would stop here
                self._left.add(ticket)
                self._pass_on()
                raise

    def __exit__(self, *exc_info: object) -> None:
        with self._changed:
            self._serving += 1
            self._pass_on()

    def _pass_on(self) -> None:
        """Skip the turns of those who gave up, and wake the waiters to look whose turn it is."""
        while self._serving in self._left:
            self._left.discard(self._serving)
            self._serving += 1
        self._changed.notify_all()


_sqlite_writers: weakref.WeakKeyDictionary[Engine, TurnLock] = weakref.WeakKeyDictionary()
_writers_guard = threading.Lock()
_turns_held = threading.local()  # .engines: ids of the engines whose turn this thread holds


@contextmanager
def write_scope(engine: Engine) -> Iterator[Session]:
    """session_scope for the loops' write transactions (intake, dispatch, reconcile), in which each
    job's work may have a savepoint of its own.

    SQLite lets one writer in at a time and makes the others wait in its busy handler, which sleeps
    between tries (up to 100 ms a sleep). Under a burst of POSTs the intake commits again and again,
    and the dispatcher's claim waited many sleeps for a turn. So on SQLite this process's
    writers take turns on a lock, in the order they asked (TurnLock), and the next one starts as
    soon as the last commits. PostgreSQL locks rows, not the database: no lock there.
    """
    with writer_turn(engine), session_scope(engine) as session:
        if is_sqlite(str(engine.url)):
            # Python's sqlite3 begins a transaction only before a data change: a SAVEPOINT (a job's
            # bulkhead, service.bulkhead) sent first would open one itself, and its RELEASE
            # would COMMIT it. So the transaction begins here, with the write lock it is for: one
            # that read first and wrote later fails at once where another connection (another
            # engine, a CLI command) committed meanwhile, instead of waiting for its turn.
            session.connection().exec_driver_sql("BEGIN IMMEDIATE")
        yield session


@contextmanager
def writer_turn(engine: Engine) -> Iterator[None]:
    """This process's turn to write to a SQLite ledger (a no-op on PostgreSQL, which locks rows).

    A turn taken inside another on the same thread would wait for that one's write lock for ever:
    RuntimeError instead."""
    if not is_sqlite(str(engine.url)):
        yield
        return
    held: set[int] = _turns_held.__dict__.setdefault("engines", set())
    if id(engine) in held:
        raise RuntimeError("a write scope inside another on this thread would wait for itself")
    with _writers_guard:
        lock = _sqlite_writers.setdefault(engine, TurnLock())
    with lock:
        held.add(id(engine))
        try:
            yield
        finally:
            held.discard(id(engine))
