"""The outbox (service.domain.outbox) and the notify loop (service.loops.notify) on a real ledger
(SQLite and PostgreSQL): notices written by the transitions door, fanned out to the subscriptions that
match, sent under a lease that two replicas cannot both hold, and the host lists checked again at
delivery (a DNS change after the subscription was made)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.bulkhead import Bulkhead
from service.config import Settings
from service.domain import deliveries, notifications, outbox, webhook_hosts
from service.domain.auth import Principal
from service.domain.transitions import record_transition
from service.ledger.db import session_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.notifications import Delivery, Notice, Subscription, SubscriptionCreate
from service.ledger.models.pipelines import Pipeline, PipelineStage
from service.loops.notify import Notifier
from service.states import JobState
from tests.webhook_receiver import Receiver, receiving

ALICE = Principal("alice")


@pytest.fixture
def hooks(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "webhook_hosts": ["127.0.0.1", "hooks.example.org"],
            "webhook_private_hosts": ["127.0.0.1"],
            "webhook_ports": ["1024-65535"],  # the receivers' free ports
            "webhook_backoff_s": 0.0,
            "webhook_max_attempts": 2,
        }
    )


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as one:
        yield one


def new_job(session: Session, owner: str = "alice", pipeline_id: int | None = None) -> Job:
    job = Job(name="j", owner=owner, backend="local", spec={}, state=JobState.queued, pipeline_id=pipeline_id)
    session.add(job)
    session.flush()
    return job


def end(session: Session, job: Job, state: JobState = JobState.failed) -> None:
    record_transition(session, job, JobState.submitted, external_id="x")
    record_transition(session, job, JobState.running)
    record_transition(session, job, state, "why\nmore")


def subscription(session: Session, owner: str = "alice", **fields: object) -> Subscription:
    row = Subscription(owner=owner, url="http://127.0.0.1:9/h", secret="s" * 64, **fields)  # type: ignore[arg-type]
    session.add(row)
    session.flush()
    return row


def test_the_door_writes_notices_and_fan_out_matches_subscriptions(engine: Engine) -> None:
    with session_scope(engine) as session:
        pipeline = Pipeline(name="p", owner="alice", request={})
        session.add(pipeline)
        session.flush()
        one, two, staged = new_job(session), new_job(session), new_job(session, pipeline_id=pipeline.id)
        session.add(PipelineStage(pipeline_id=pipeline.id or 0, name="x", position=0, job_id=staged.id))
        bobs = new_job(session, owner="bob")
        everything = subscription(session, on=["failed", "succeeded"])
        of_one = subscription(session, on=["ended"], job_id=one.id)
        running_two = subscription(session, on=["running"], job_id=two.id)
        of_pipeline = subscription(session, on=["failed"], pipeline_id=pipeline.id)
        bobs_own = subscription(session, owner="bob", on=["ended"])
        admin_on_bobs = subscription(session, owner="root", on=["ended"], job_id=bobs.id)
        for job in (one, two, staged, bobs):
            end(session, job)  # staged's ending ends its pipeline too: the door writes that notice
    with session_scope(engine) as session:
        states = sorted((n.job_id or 0, n.state) for n in session.exec(select(Notice)))
    ids = [j.id or 0 for j in (one, two, staged, bobs)]
    # running and failed of each job (submitted is not told), and the pipeline's
    assert states == sorted([(i, s) for i in ids for s in ("running", "failed")] + [(0, "failed")])

    guard = Bulkhead(outbox.FAN_OUT)
    with session_scope(engine) as session:
        assert outbox.fan_out(session, "http://ty", guard, 200) == 9
    with session_scope(engine) as session:
        assert session.exec(select(Notice)).all() == []
        got = {
            (d.subscription_id, d.event, d.job_id or d.pipeline_id) for d in session.exec(select(Delivery))
        }
    assert got == {
        (everything.id, "job.failed", one.id), (everything.id, "job.failed", two.id),
        (everything.id, "job.failed", staged.id),
        (of_one.id, "job.failed", one.id),
        (running_two.id, "job.running", two.id),
        (of_pipeline.id, "job.failed", staged.id), (of_pipeline.id, "pipeline.failed", pipeline.id),
        (everything.id, "pipeline.failed", pipeline.id),
        (bobs_own.id, "job.failed", bobs.id), (admin_on_bobs.id, "job.failed", bobs.id),
    }  # fmt: skip


def test_two_replicas_never_hold_one_delivery_and_a_lost_lease_is_taken_over(
    engine: Engine, hooks: Settings, receiver: Receiver
) -> None:
    with session_scope(engine) as session:
        subscription(session, on=["failed"]).url = receiver.url
        end(session, new_job(session))
        end(session, new_job(session))
    a, b = Notifier(engine, hooks), Notifier(engine, hooks)
    try:
        with session_scope(engine) as session:
            outbox.fan_out(session, "http://ty", a.fan_out_guard, 200)
        with session_scope(engine) as session:
            taken = deliveries.claim_fairly(session, a.me, 60, slots=8, per_owner=8)
        with session_scope(engine) as session:
            assert len(taken) == 2 and deliveries.claim_fairly(session, b.me, 60, slots=8, per_owner=8) == []
        # a dies holding them: once its lease ends, b sends them (same delivery ids)
        with session_scope(engine) as session:
            session.connection().execute(
                update(Delivery).values(claimed_until=utcnow() - timedelta(seconds=1))
            )
        assert b.run_pass() == 2
        b.wait_idle()
        late = deliveries.Outcome(False, error="a's late answer")
        with session_scope(engine) as session:  # a's settling, too late, changes nothing
            deliveries.settle(session, taken[0], a.me, late, max_attempts=9, backoff=lambda n: 0.0)
        with session_scope(engine) as session:
            rows = session.exec(select(Delivery)).all()
        assert {(d.status, d.attempts, d.last_error) for d in rows} == {("delivered", 2, None)}
        assert sorted(r.headers["x-torchyard-delivery"] for r in receiver.all()) == sorted(
            d.delivery_id for d in rows
        )
    finally:
        a.stop()
        b.stop()


def test_a_dns_change_after_subscribing_is_refused_at_delivery(
    engine: Engine, hooks: Settings, receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = ["93.184.216.34"]
    monkeypatch.setattr(webhook_hosts, "resolve", lambda host, port: list(answers))
    body = SubscriptionCreate(url=f"http://hooks.example.org:{receiver.port}/h", on=["failed"])
    notifications.subscribe(engine, hooks, ALICE, body)
    answers[:] = ["127.0.0.1"]  # the name now points inside
    with session_scope(engine) as session:
        end(session, new_job(session))
    notifier = Notifier(engine, hooks)
    try:
        notifier.run_pass()
        notifier.wait_idle()
    finally:
        notifier.stop()
    with session_scope(engine) as session:
        (row,) = session.exec(select(Delivery)).all()
    assert row.status == "failed" and row.attempts == 1  # for good: not tried again
    assert row.last_error is not None and "refused: hooks.example.org resolves to 127.0.0.1" in row.last_error
    assert receiver.all() == []


def test_redirects_are_refused_and_a_removed_subscription_fails_its_deliveries(
    engine: Engine, hooks: Settings, receiver: Receiver
) -> None:
    receiver.answers[:] = [302, 302]
    with session_scope(engine) as session:
        sub = subscription(session, on=["failed"])
        sub.url = receiver.url
        other = subscription(session, on=["failed"])
        end(session, new_job(session))
    notifier = Notifier(engine, hooks)
    try:
        with session_scope(engine) as session:
            outbox.fan_out(session, "http://ty", notifier.fan_out_guard, 200)
            later = update(Delivery).where(col(Delivery.subscription_id) == other.id)
            session.connection().execute(later.values(next_at=utcnow() + timedelta(hours=1)))
        for _ in range(2):
            notifier.run_pass()
            notifier.wait_idle()
        with session_scope(engine) as session:
            (row,) = session.exec(select(Delivery).where(col(Delivery.subscription_id) == sub.id)).all()
            assert row.status == "failed" and row.attempts == 2 and row.last_status == 302
            assert row.last_error == "HTTP 302: redirects are not followed"  # not where to
        with session_scope(engine) as session:
            notifications.remove_subscription(session, other.id or 0, ALICE)
        with session_scope(engine) as session:
            gone = session.exec(select(Delivery).where(col(Delivery.subscription_id) == other.id)).one()
            assert gone.status == "failed" and gone.last_error == notifications.REMOVED and gone.attempts == 0
    finally:
        notifier.stop()
    assert len(receiver.all()) == 2
