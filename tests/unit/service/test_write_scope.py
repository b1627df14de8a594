"""write_scope: on SQLite the loops' writers take turns on a lock in this process (SQLite's busy handler
would make them sleep-and-retry instead); on PostgreSQL they run side by side, rows lock themselves."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import select

from service.ledger.db import TurnLock, is_sqlite, write_scope
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


def wait_until_asked(lock: TurnLock, tickets: int) -> None:
    """Until `tickets` turns have been asked for (the waiters are in line)."""
    for _ in range(1000):
        if lock._next_ticket >= tickets:
            return
        threading.Event().wait(0.005)
    raise AssertionError(f"{tickets} turns were never asked for")


def test_turns_go_in_the_order_they_were_asked_even_to_a_writer_in_a_loop() -> None:
    """A writer that writes again and again (a fan-out's chunks) lets each writer that asked meanwhile
    go first: with threading.Lock, the loop could take its next turn before the waiter woke."""
    lock, order = TurnLock(), []

    def other(name: str) -> None:
        with lock:
            order.append(name)

    lock.__enter__()  # the loop's first chunk
    waiters = [threading.Thread(target=other, args=(name,)) for name in ("alice", "bob")]
    for count, waiter in enumerate(waiters, start=2):
        waiter.start()
        wait_until_asked(lock, count)
    lock.__exit__()
    with lock:  # the loop's next chunk asks at once
        order.append("loop")
    for waiter in waiters:
        waiter.join(10)
    assert order == ["alice", "bob", "loop"]


def test_a_waiter_that_gives_up_passes_its_turn_on() -> None:
    lock, gave_up, after = TurnLock(), [], threading.Event()

    def impatient() -> None:
        try:
            with lock:
                pass
        except KeyboardInterrupt:
            gave_up.append(True)

    def patient() -> None:
        with lock:
            after.set()

    lock.__enter__()
    condition = lock._changed
    real_wait = condition.wait

    def interrupted(timeout: float | None = None) -> bool:
        if threading.current_thread().name == "impatient":
            raise KeyboardInterrupt
        return real_wait(timeout)

    condition.wait = interrupted  # type: ignore[method-assign]
    first = threading.Thread(target=impatient, name="impatient")
    first.start()
    first.join(10)
    second = threading.Thread(target=patient)
    second.start()
    wait_until_asked(lock, 3)
    lock.__exit__()
    assert after.wait(10), "the turn stopped at the waiter that gave up"
    assert gave_up == [True]
