"""The polls' first reads are made once per turn of the event loop (service.api.reader.TurnReads):
one read for every poll that asked in the turn, begun after they asked, each answered its own; the
polls that ask while a read is in flight share the next one, begun when it ends."""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.api.reader import LedgerReader, TurnReads
from service.domain import jobs
from service.domain.auth import Principal
from service.errors import NotFound
from service.ledger.db import session_scope
from service.ledger.models.jobs import Job
from tests.support import run_async


class Recorded:
    """A read_many that records the keys of each call and answers the even ones (odd: not found)."""

    def __init__(self) -> None:
        self.calls: list[set[int]] = []
        self.log: list[str] = []

    async def __call__(self, keys: Collection[int]) -> dict[int, str]:
        self.calls.append(set(keys))
        self.log.append("read")
        return {key: f"value {key}" for key in keys if key % 2 == 0}


def test_the_askers_of_one_turn_share_one_read_begun_after_they_asked() -> None:
    recorded = Recorded()
    reads = TurnReads(recorded)

    async def ask(key: int) -> str | None:
        recorded.log.append(f"ask {key}")
        return await reads.read(key)

    async def scenario() -> list[str | None]:
        return await asyncio.gather(*(ask(key) for key in (2, 2, 3, 4)))

    answers = run_async(scenario())

    assert answers == ["value 2", "value 2", None, "value 4"]
    assert recorded.calls == [{2, 3, 4}]
    assert recorded.log == ["ask 2", "ask 2", "ask 3", "ask 4", "read"]  # the read began after every ask


def test_a_later_turn_reads_again() -> None:
    recorded = Recorded()
    reads = TurnReads(recorded)

    async def scenario() -> None:
        assert await reads.read(2) == "value 2"
        assert await reads.read(2) == "value 2"  # asked after the first read: a read of its own

    run_async(scenario())
    assert recorded.calls == [{2}, {2}]


def test_an_error_of_the_read_is_every_askers_and_a_hung_up_asker_is_left_out() -> None:
    async def broken(keys: Collection[int]) -> dict[int, str]:
        raise ConnectionError("the database is down")

    reads = TurnReads(broken)

    async def scenario() -> list[BaseException | str | None]:
        hung_up = asyncio.ensure_future(reads.read(1))
        others = [asyncio.ensure_future(reads.read(key)) for key in (1, 2)]
        await asyncio.sleep(0)  # every asker has asked; the read has not run yet
        hung_up.cancel()
        return await asyncio.gather(*others, return_exceptions=True)

    answers = run_async(scenario())

    assert [type(answer) for answer in answers] == [ConnectionError, ConnectionError]


def test_the_askers_during_a_read_in_flight_share_the_next_read_begun_after_it() -> None:
    """On PostgreSQL the loop serves on while a read is in flight; the polls that ask meanwhile
    must not get its answer (it began before they asked), nor start reads beside it."""
    log: list[str] = []
    release = asyncio.Event()

    async def slow(keys: Collection[int]) -> dict[int, str]:
        log.append(f"read {sorted(keys)} begins")
        if not release.is_set():
            await release.wait()
        log.append(f"read {sorted(keys)} ends")
        return {key: f"value {key}" for key in keys}

    reads = TurnReads(slow)

    async def scenario() -> list[str | None]:
        first = asyncio.ensure_future(reads.read(1))
        await asyncio.sleep(0.01)  # the first read is in flight
        later = [asyncio.ensure_future(reads.read(key)) for key in (2, 3)]
        await asyncio.sleep(0.01)
        log.append("released")
        release.set()
        return await asyncio.gather(first, *later)

    answers = run_async(scenario())

    assert answers == ["value 1", "value 2", "value 3"]
    assert log == ["read [1] begins", "released", "read [1] ends", "read [2, 3] begins", "read [2, 3] ends"]


def add_job(engine: Engine, owner: str) -> int:
    with session_scope(engine) as session:
        job = Job(name=f"{owner}'s", owner=owner, backend="local", spec={})
        session.add(job)
        session.flush()
        assert job.id is not None
        return job.id


def test_one_stamp_read_answers_each_viewer_by_what_they_may_see(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Polls of different users in one turn share the read, never what it found: another user's job
    is as missing to them as no job (404), as it is polled alone."""
    alices, bobs = add_job(engine, "alice"), add_job(engine, "bob")
    alice, bob, admin = Principal("alice", False), Principal("bob", False), Principal("root", True)
    reader = LedgerReader(engine)
    reads: list[set[int]] = []
    stamps = reader._stamps._read_many

    async def recorded(keys: Collection[int]) -> dict[int, jobs.Stamp]:
        reads.append(set(keys))
        return await stamps(keys)

    monkeypatch.setattr(reader._stamps, "_read_many", recorded)

    async def scenario() -> list[object]:
        asks = [
            reader.job_stamp(alices, alice),
            reader.job_stamp(alices, bob),
            reader.job_stamp(bobs, bob),
            reader.job_stamp(bobs, admin),
            reader.job_stamp(bobs + 1000, admin),
        ]
        return await asyncio.gather(*asks, return_exceptions=True)

    answers = run_async(scenario())
    reader.close()

    with Session(engine) as session:
        expected = {job_id: session.get(Job, job_id).updated_at for job_id in (alices, bobs)}  # type: ignore[union-attr]
    assert reads == [{alices, bobs, bobs + 1000}]
    assert answers[0] == expected[alices]
    assert isinstance(answers[1], NotFound)
    assert answers[2] == answers[3] == expected[bobs]
    assert isinstance(answers[4], NotFound)
