"""A dispatch tick claims owners in turn: one user's hundreds of queued jobs never hold another
user's job back for more than one place a round (the house's fair share, for the dispatch thread)."""

from __future__ import annotations

from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.config import Settings
from service.ledger.models.jobs import Job
from service.loops.dispatch import Dispatcher
from tests.fakes import FakeBackend

SPEC = {"entrypoint": "worker.tasks.faults:sleep", "resources": {}}


def queued(engine: Engine, settings: Settings, owner: str, count: int) -> list[int]:
    ids: list[int] = []
    with Session(engine) as session:
        for n in range(count):
            job = Job(name=f"{owner}{n}", owner=owner, backend="slurm", spec=SPEC)
            session.add(job)
            session.flush()
            assert job.id is not None
            job.folder = str(settings.data_dir / "jobs" / str(job.id))
            ids.append(job.id)
        session.commit()
    return ids


def test_a_tick_claims_owners_in_turn(engine: Engine, settings: Settings) -> None:
    settings.dispatch_batch_size = 6
    flood = queued(engine, settings, "mallory", 30)
    alice = queued(engine, settings, "alice", 2)
    bob = queued(engine, settings, "bob", 1)
    fake = FakeBackend("slurm")

    claimed = Dispatcher(engine, {"slurm": fake}, settings).dispatch_once()

    assert claimed == 6
    [handed] = fake.submit_calls
    # Each owner's oldest first (in id order among the owners), then each one's second, ...
    assert handed == [flood[0], alice[0], bob[0], flood[1], alice[1], flood[2]]


def test_one_owner_alone_still_fills_the_batch_in_id_order(engine: Engine, settings: Settings) -> None:
    settings.dispatch_batch_size = 4
    jobs = queued(engine, settings, "alice", 10)
    fake = FakeBackend("slurm")

    Dispatcher(engine, {"slurm": fake}, settings).dispatch_once()

    assert fake.submit_calls == [jobs[:4]]
