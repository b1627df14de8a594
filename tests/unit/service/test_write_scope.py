"""write_scope: on SQLite the loops' writers take turns on a lock in this process (SQLite's busy handler
would make them sleep-and-retry instead); on PostgreSQL they run side by side, rows lock themselves."""

from __future__ import annotations

import threading

from sqlalchemy.engine import Engine
from sqlmodel import select

from service.ledger.db import is_sqlite, write_scope
from service.ledger.models import Job


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


def test_a_write_scope_inside_another_on_the_same_thread_does_not_wait_for_itself(engine: Engine) -> None:
    with write_scope(engine):
        done = threading.Event()

        def nested() -> None:
            with write_scope(engine):
                done.set()

        nested()  # re-entrant on this thread: a deadlock here would hang the test
        assert done.is_set()
