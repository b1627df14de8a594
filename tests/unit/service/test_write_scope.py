"""write_scope: on SQLite the loops' writers take turns on a lock in this process (SQLite's busy handler
would make them sleep-and-retry instead); on PostgreSQL they run side by side, rows lock themselves."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import select

from service.ledger.db import is_sqlite, write_scope
from service.ledger.models.jobs import Job


def test_a_second_writer_starts_when_the_first_commits_and_sees_its_rows(engine: Engine) -> None:
    first_in, release = threading.Event(), threading.Event()
    second_in = threading.Event()
    seen: list[int] = []

    def first() -> None:
        with write_scope(engine) as session:
            session.add(Job(name="first", backend="slurm", spec={"entrypoint": "worker.tasks.faults:sleep"}))
            session.flush()
            first_in.set()
            release.wait(10)

    def second() -> None:
        first_in.wait(10)
        with write_scope(engine) as session:
            seen.append(len(session.exec(select(Job)).all()))
            second_in.set()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    assert first_in.wait(10)
    held_off = not second_in.wait(0.3)  # on PostgreSQL nothing holds the second one back
    release.set()
    for thread in threads:
        thread.join(10)

    assert held_off is is_sqlite(str(engine.url))
    assert seen == ([1] if held_off else [0])  # a turn begins after the last one committed


def test_a_write_scope_inside_another_on_the_same_thread_says_so_instead_of_waiting_for_itself(
    engine: Engine,
) -> None:
    """On SQLite a write scope holds the ledger's write lock from its start (savepoints need a real
    transaction), so one inside another on the same thread could only wait for itself: it is refused
    at once. PostgreSQL locks rows: two scopes of one thread are two transactions there."""
    with write_scope(engine) as outer:
        outer.exec(select(Job)).all()
        if is_sqlite(str(engine.url)):
            with pytest.raises(RuntimeError, match="would wait for itself"), write_scope(engine):
                pass
        else:
            with write_scope(engine) as inner:
                inner.exec(select(Job)).all()
    with write_scope(engine) as after:  # the turn was given back
        after.exec(select(Job)).all()
