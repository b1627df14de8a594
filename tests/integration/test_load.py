"""Load: 32 users submit 500 jobs each at once over real HTTP, half of them twice with one
Idempotency-Key (a retry after the answer, or two requests racing), and the ledger must hold exactly
one job per request: none lost, none doubled.

The service is the real one (uvicorn on loopback, group-commit intake, dispatch and reconcile loops)
with a fake backend whose jobs succeed at once, so what is measured is the service, not the jobs.
The throughput is printed.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from sqlalchemy import func
from sqlmodel import Session, col, select

from service.app import create_app
from service.config import Settings
from service.ledger.models.access import AuditEntry
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.fakes import FakeBackend
from tests.load_client import Answer, idempotency_key, job_body, run_load
from tests.serving import serve
from tests.support import issue_token

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

USERS = 32
JOBS_PER_USER = 500


def load_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            # 750 POSTs per user in a minute or two: the quotas' own tests cover the limits.
            "max_active_jobs_per_user": 100_000,
            "max_submissions_per_minute": 100_000,
            # The service's default pace, not the suite's 50 ms: the loops run, they do not spin.
            "dispatch_interval_s": 1.0,
            "local_reconcile_interval_s": 0.25,
        }
    )


def check_answers(answers: list[Answer]) -> dict[tuple[str, int], int]:
    """Every request got its job: one 201 per job, every retry a 200 naming the same job."""
    bad = [answer for answer in answers if answer.status not in (200, 201)]
    assert not bad, f"{len(bad)} POSTs failed, e.g. {bad[:3]}"
    by_request: dict[tuple[str, int], list[Answer]] = defaultdict(list)
    for answer in answers:
        by_request[(answer.user, answer.index)].append(answer)
    assert len(by_request) == USERS * JOBS_PER_USER
    job_of: dict[tuple[str, int], int] = {}
    for request, sent in by_request.items():
        keyed = idempotency_key(*request) is not None
        assert len(sent) == (2 if keyed else 1), sent
        assert sorted(answer.status for answer in sent) == ([200, 201] if keyed else [201]), sent
        ids = {answer.job_id for answer in sent}
        assert len(ids) == 1 and None not in ids, sent  # the retry names the job the first one made
        job_of[request] = ids.pop()  # type: ignore[assignment]
    assert len(set(job_of.values())) == len(job_of), "two requests were answered with one job"
    return job_of


def check_ledger(session: Session, job_of: dict[tuple[str, int], int]) -> None:
    """The ledger holds exactly the answered jobs, each with one acceptance, and nothing else."""
    columns = [col(Job.id), col(Job.owner), col(Job.name), col(Job.idempotency_key), col(Job.spec)]
    rows = session.connection().execute(sa.select(*columns)).all()
    assert len(rows) == USERS * JOBS_PER_USER
    stored = {job_id: (owner, name, key, spec) for job_id, owner, name, key, spec in rows}
    assert set(stored) == set(job_of.values()), "a job was lost, or one nobody was told about exists"
    for (user, index), job_id in job_of.items():
        owner, name, key, spec = stored[job_id]
        assert (owner, name, key) == (user, job_body(user, index)["name"], idempotency_key(user, index))
        assert spec["kwargs"] == {"n": index}
    assert Counter(owner for owner, *_ in stored.values()) == {user: JOBS_PER_USER for user, _ in job_of}
    keyed = [(owner, key) for owner, _, key, _ in stored.values() if key is not None]
    assert len(keyed) == len(set(keyed)) == USERS * JOBS_PER_USER // 2

    accepted = session.exec(
        select(col(JobEvent.job_id), func.count())
        .where(JobEvent.reason == "accepted")
        .group_by(col(JobEvent.job_id))
    ).all()
    assert dict(accepted) == dict.fromkeys(stored, 1), "a job was accepted twice or not at all"
    submits = session.exec(
        select(func.count()).select_from(AuditEntry).where(AuditEntry.action == "job.submit")
    ).one()
    assert submits == len(stored)


def test_32_clients_submitting_at_once_with_retries_leave_exactly_one_job_per_request(
    settings: Settings, record_property: Callable[[str, object], None]
) -> None:
    fake = FakeBackend("local", default=JobState.succeeded)
    app = create_app(load_settings(settings), backends={"local": fake})
    with serve(app) as live:
        engine = live.runtime.engine
        tokens = {f"user{n:02d}": issue_token(engine, f"user{n:02d}") for n in range(USERS)}
        result = run_load(live.url, tokens, JOBS_PER_USER, timeout_s=60, deadline_s=240)
        jobs = USERS * JOBS_PER_USER
        print(
            f"\nload: {USERS} clients, {jobs} jobs, {result.posts} POSTs "
            f"({result.posts - jobs} Idempotency-Key retries) in {result.seconds:.1f} s: "
            f"{jobs / result.seconds:.0f} jobs/s, {result.posts / result.seconds:.0f} POSTs/s; "
            f"{live.runtime.intake.batches_committed} intake commits"
        )
        record_property("load_jobs_per_s", round(jobs / result.seconds, 1))
        record_property("load_posts", result.posts)
        job_of = check_answers(result.answers)
        with Session(engine) as session:
            check_ledger(session, job_of)
            # How far dispatch got meanwhile: reported, not asserted (its own tests hold it to account).
            dispatched = session.exec(
                select(func.count()).select_from(Job).where(col(Job.state) != JobState.queued)
            ).one()
        print(f"load: {dispatched} of {jobs} jobs already dispatched when the last answer came")
