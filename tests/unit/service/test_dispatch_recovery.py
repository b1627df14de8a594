"""Claims a dead dispatcher left behind: what the backend already has is adopted, the rest is submitted
again, and a job the backend cannot tell about yet keeps its claim (no second submission)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service.config import Settings
from service.ledger.models.columns import utcnow
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job
from service.loops.dispatch import STALE_CHECK_EVERY_S, Dispatcher
from service.states import JobState
from tests.fakes import FakeBackend

DEAD_REPLICA = "nowhere:1"  # another host: only the claim's age makes it stale


def stale_claims(engine: Engine, tmp_path: Path, count: int) -> list[int]:
    """Queued jobs claimed two minutes ago by a replica that is gone, with their (empty) folders."""
    ids: list[int] = []
    with Session(engine) as session:
        for n in range(count):
            folder = tmp_path / "jobs" / str(n)
            (folder / "submitit").mkdir(parents=True)
            job = Job(
                name=f"j{n}",
                backend="slurm",
                folder=str(folder),
                claimed_by=DEAD_REPLICA,
                claimed_at=utcnow().replace(year=2000),
                spec={"entrypoint": "worker.tasks.faults:sleep", "resources": {}},
            )
            session.add(job)
            session.flush()
            assert job.id is not None
            ids.append(job.id)
        session.commit()
    return ids


def ledger(engine: Engine) -> dict[int, tuple[str, str | None, str | None]]:
    """job id -> (state, external id, claimed by)."""
    with Session(engine) as session:
        return {
            job.id or 0: (job.state, job.external_id, job.claimed_by) for job in session.exec(select(Job))
        }


def reasons(engine: Engine, job_id: int) -> list[str]:
    with Session(engine) as session:
        query = select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.id)  # type: ignore[arg-type]
        return [event.reason or "" for event in session.exec(query)]


def dispatcher(engine: Engine, settings: Settings, fake: FakeBackend) -> Dispatcher:
    return Dispatcher(engine, {"slurm": fake}, settings)


def test_a_job_the_scheduler_got_while_its_dispatcher_died_is_adopted_not_resubmitted(
    engine: Engine, settings: Settings, tmp_path: Path
) -> None:
    adopted, fresh = stale_claims(engine, tmp_path, 2)
    fake = FakeBackend("slurm")
    fake.recovered = {tmp_path / "jobs" / "0": "700_3"}

    dispatcher(engine, settings, fake).dispatch_once()

    assert fake.recover_calls == [[tmp_path / "jobs" / "0", tmp_path / "jobs" / "1"]]  # one call for both
    assert fake.submit_calls == [[fresh]]  # never the adopted one
    found = ledger(engine)
    assert found[adopted] == (JobState.submitted, "700_3", None)
    assert "adopted after a dispatcher restart" in reasons(engine, adopted)
    assert found[fresh] == (JobState.submitted, fake.external_id(fresh), None)


def test_a_submitted_pickle_the_scheduler_does_not_disown_is_enough(
    engine: Engine, settings: Settings, tmp_path: Path
) -> None:
    (job_id,) = stale_claims(engine, tmp_path, 1)
    (tmp_path / "jobs" / "0" / "submitit" / "41_submitted.pkl").write_bytes(b"")
    fake = FakeBackend("slurm")

    dispatcher(engine, settings, fake).dispatch_once()

    assert fake.recover_calls == [] and fake.submit_calls == []
    assert ledger(engine)[job_id] == (JobState.submitted, "41", None)


def test_a_submitted_pickle_naming_another_folder_s_job_is_not_adopted(
    engine: Engine, settings: Settings, tmp_path: Path
) -> None:
    # The job's account renamed a file the service made in its folder after another user's SLURM job:
    # adopted, that job would be polled and cancelled (as root) as this one.
    (job_id,) = stale_claims(engine, tmp_path, 1)
    (tmp_path / "jobs" / "0" / "submitit" / "999_submitted.pkl").write_bytes(b"")
    fake = FakeBackend("slurm")
    fake.others_jobs = {tmp_path / "jobs" / "0"}

    dispatcher(engine, settings, fake).dispatch_once()

    assert fake.recover_calls == [[tmp_path / "jobs" / "0"]]  # as if it had no pickle
    assert ledger(engine)[job_id] == (JobState.submitted, fake.external_id(job_id), None)
    assert fake.cancel_calls == []


def test_a_submitted_pickle_that_cannot_be_checked_yet_keeps_its_claim(
    engine: Engine, settings: Settings, tmp_path: Path
) -> None:
    (job_id,) = stale_claims(engine, tmp_path, 1)
    (tmp_path / "jobs" / "0" / "submitit" / "41_submitted.pkl").write_bytes(b"")
    fake = FakeBackend("slurm")
    fake.recover_error = "Unable to contact slurm controller"

    dispatcher(engine, settings, fake).dispatch_once()

    assert fake.submit_calls == []
    assert ledger(engine)[job_id] == (JobState.queued, None, DEAD_REPLICA)


@pytest.mark.parametrize("why", ["undecided", "unreachable"])
def test_a_job_the_backend_cannot_tell_about_yet_keeps_its_claim_until_it_can(
    engine: Engine, settings: Settings, tmp_path: Path, why: str
) -> None:
    (job_id,) = stale_claims(engine, tmp_path, 1)
    fake = FakeBackend("slurm")
    if why == "undecided":
        fake.undecided = {tmp_path / "jobs" / "0"}
    else:
        fake.recover_error = "slurmctld is not responding"
    recovering = dispatcher(engine, settings, fake)

    recovering.dispatch_once()

    assert fake.submit_calls == []  # an sbatch of the dead dispatcher may still queue it
    assert ledger(engine)[job_id] == (JobState.queued, None, DEAD_REPLICA)

    fake.undecided, fake.recover_error = set(), None
    recovering.dispatch_once()

    assert fake.submit_calls == [[job_id]]
    assert ledger(engine)[job_id] == (JobState.submitted, fake.external_id(job_id), None)


def test_a_dispatcher_that_found_no_stale_claims_looks_again_after_a_few_seconds(
    engine: Engine, settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look for a dead dispatcher's claims is a query of its own: made at the first tick, at
    every tick while claims are kept (the test above), and otherwise every STALE_CHECK_EVERY_S."""
    fake = FakeBackend("slurm")
    watching = dispatcher(engine, settings, fake)
    watching.dispatch_once()  # nothing is claimed yet
    (job_id,) = stale_claims(engine, tmp_path, 1)

    watching.dispatch_once()

    assert ledger(engine)[job_id] == (JobState.queued, None, DEAD_REPLICA)
    later = time.monotonic() + STALE_CHECK_EVERY_S
    monkeypatch.setattr(time, "monotonic", lambda: later)
    watching.dispatch_once()

    assert fake.submit_calls == [[job_id]]
    assert ledger(engine)[job_id] == (JobState.submitted, fake.external_id(job_id), None)
