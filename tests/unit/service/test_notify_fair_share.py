"""Fair share in the notify loop (issue 43, findings 2, 3 and 5) on a real ledger (SQLite and
PostgreSQL) with real receivers on 127.0.0.1: a slow-drip receiver is cut at the total deadline
while another user's webhook goes out; claims go round-robin by owner; a notice fans out in chunks,
each its own transaction, resumable; old deliveries are pruned; a receiver's words never reach
`last_error`; the connection goes to the address that was checked; unlisted ports are refused."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, insert
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.bulkhead import Bulkhead
from service.config import Settings
from service.domain import deliveries, notifications, outbox
from service.domain.transitions import record_transition
from service.ledger.db import session_scope, write_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.notifications import Delivery, Notice, Subscription
from service.loops import webhook_send
from service.loops.housekeeping import Housekeeper
from service.loops.notify import Notifier
from service.states import JobState
from tests.support import wait_for
from tests.webhook_receiver import TOKEN, Receiver, dripping, receiving

DEADLINE_S = 1.0


@pytest.fixture
def hooks(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "webhook_hosts": ["127.0.0.1", "hooks.example.org"],
            "webhook_private_hosts": ["127.0.0.1", "hooks.example.org"],
            "webhook_ports": ["1024-65535"],  # the receivers' free ports
            "webhook_backoff_s": 0.0,
            "webhook_max_attempts": 2,
            "webhook_read_timeout_s": 10.0,  # per read: never fires on a byte a second
            "webhook_total_timeout_s": DEADLINE_S,
            "notify_interval_s": 0.05,
        }
    )


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with receiving() as one:
        yield one


def new_job(session: Session, owner: str) -> Job:
    job = Job(name="j", owner=owner, backend="local", spec={}, state=JobState.queued)
    session.add(job)
    session.flush()
    return job


def fail(session: Session, job: Job) -> None:
    record_transition(session, job, JobState.submitted, external_id="x")
    record_transition(session, job, JobState.running)
    record_transition(session, job, JobState.failed, "boom")


def subscribe(session: Session, owner: str, url: str, on: list[str] | None = None) -> Subscription:
    row = Subscription(owner=owner, url=url, secret="s" * 64, on=on or ["failed"])
    session.add(row)
    session.flush()
    return row


def delivery(owner: str, subscription_id: int, url: str, **fields: Any) -> dict[str, Any]:
    now = utcnow()
    row: dict[str, Any] = {
        "delivery_id": str(uuid.uuid4()), "subscription_id": subscription_id, "owner": owner, "url": url,
        "event": "job.failed", "payload": {}, "status": "pending", "attempts": 0, "next_at": now,
        "created_at": now,
    }  # fmt: skip
    return {**row, **fields}


def rows_of(engine: Engine, owner: str) -> list[Delivery]:
    with session_scope(engine) as session:
        return list(session.exec(select(Delivery).where(col(Delivery.owner) == owner)).all())


def test_a_slow_drip_receiver_is_cut_at_the_total_deadline_and_holds_no_one_else(
    engine: Engine, hooks: Settings, receiver: Receiver
) -> None:
    """Finding 2: alice's receiver answers a byte a second (httpx's per-read timeout never fires on
    it); bob's webhook, due while it drips, goes out at once, and alice's try ends at the deadline."""
    with dripping(every_s=1.0) as drip:
        with session_scope(engine) as session:
            subscribe(session, "alice", drip.url)
            subscribe(session, "bob", receiver.url)
            fail(session, new_job(session, "alice"))
        notifier = Notifier(engine, hooks.model_copy(update={"webhook_max_attempts": 1}))
        notifier.start()
        try:
            assert drip.connected.wait(10), "alice's delivery reached her receiver"
            dripping_since = time.monotonic()
            with session_scope(engine) as session:
                fail(session, new_job(session, "bob"))
            wait_for(lambda: receiver.taken() or None, timeout=5, what="bob's webhook while alice's drips")
            bob_waited = time.monotonic() - dripping_since
            (cut,) = wait_for(
                lambda: [d for d in rows_of(engine, "alice") if d.last_error] or None,
                timeout=10,
                what="the cut",
            )
            cut_after = time.monotonic() - dripping_since
        finally:
            notifier.stop()
    assert cut.last_error == webhook_send.TIMED_OUT and cut.status == "failed" and cut.attempts == 1
    assert cut_after < DEADLINE_S + 1.5, f"alice's try ran {cut_after:.1f} s past a {DEADLINE_S} s deadline"
    assert bob_waited < 2.0, f"bob's webhook waited {bob_waited:.1f} s on alice's receiver"


def test_claims_go_round_robin_by_owner_within_each_owners_share(engine: Engine) -> None:
    """Finding 2/3: alice has 60 due deliveries, all older than bob's one. The claim used to take the
    50 oldest (bob's not among them); now bob's goes in the first round, and alice never holds
    more than her share of senders, on this replica or another."""
    with session_scope(engine) as session:
        alices = subscribe(session, "alice", "http://127.0.0.1:9999/a").id or 0
        bobs = subscribe(session, "bob", "http://127.0.0.1:9999/b").id or 0
        old = utcnow() - timedelta(minutes=5)
        rows = [delivery("alice", alices, "u", next_at=old + timedelta(seconds=i)) for i in range(60)]
        session.connection().execute(insert(Delivery), [*rows, delivery("bob", bobs, "u")])
    with session_scope(engine) as session:
        first = deliveries.claim_fairly(session, "replica-1", 60, slots=8, per_owner=3)
    owners = [one.owner for one in first]
    assert sorted(owners[:2]) == ["alice", "bob"], owners  # one each, then alice's next ones
    assert owners.count("alice") == 3 and owners.count("bob") == 1
    with session_scope(engine) as session:  # alice's share is in flight, on any replica
        assert deliveries.claim_fairly(session, "replica-2", 60, slots=8, per_owner=3) == []


def count(session: Session, model: type[Delivery] | type[Notice]) -> int:
    return session.exec(select(func.count()).select_from(model)).one()


def many_subscriptions(engine: Engine, how_many: int) -> int:
    """`how_many` of alice's subscriptions to failures, and a notice of her job's failure."""
    with session_scope(engine) as session:
        job = new_job(session, "alice")
        rows = [
            {"owner": "alice", "url": f"http://127.0.0.1:9999/{i}", "secret": "s" * 64, "on": ["failed"],
             "created_at": utcnow()}
            for i in range(how_many)
        ]  # fmt: skip
        session.connection().execute(insert(Subscription), rows)
        session.add(Notice(owner="alice", job_id=job.id, state="failed"))
    return job.id or 0


def test_a_notice_fans_out_in_chunks_each_its_own_transaction_and_resumes_after_a_crash(
    engine: Engine,
) -> None:
    """Finding 3: 450 matching subscriptions, chunks of 200: three transactions (200, 400, 450
    deliveries); a chunk whose transaction dies changes nothing, and the next one goes on from the
    notice's cursor: no delivery lost or made twice."""
    many_subscriptions(engine, 450)
    guard = Bulkhead(outbox.FAN_OUT)
    seen = []
    for step in range(4):
        if step == 1:  # a crash before this chunk commits
            with pytest.raises(RuntimeError), write_scope(engine) as session:
                outbox.fan_out(session, "http://ty", guard, 200)
                raise RuntimeError("the service died here")
        with write_scope(engine) as session:  # as the loop does (on SQLite, a savepoint needs it)
            outbox.fan_out(session, "http://ty", guard, 200)
        with session_scope(engine) as session:
            seen.append((count(session, Delivery), count(session, Notice)))
    assert seen == [(200, 1), (400, 1), (450, 0), (450, 0)]
    with session_scope(engine) as session:
        made = session.exec(select(Delivery.subscription_id)).all()
    assert len(set(made)) == 450


def test_owners_take_turns_in_the_fan_out(engine: Engine) -> None:
    """Finding 3: alice's notices match 450 subscriptions each; bob's one, written after them, is
    fanned out in the first chunk all the same (each owner waiting has a share of it)."""
    many_subscriptions(engine, 450)
    with session_scope(engine) as session:
        alices = new_job(session, "alice").id
        session.add(Notice(owner="alice", job_id=alices, state="failed"))
        bobs = new_job(session, "bob")
        subscribe(session, "bob", "http://127.0.0.1:9999/b")
        session.add(Notice(owner="bob", job_id=bobs.id, state="failed"))
    with write_scope(engine) as session:
        assert outbox.fan_out(session, "http://ty", Bulkhead(outbox.FAN_OUT), 200) == 2
    assert len(rows_of(engine, "bob")) == 1 and len(rows_of(engine, "alice")) == 100


def test_another_users_write_waits_a_chunk_not_the_whole_fan_out(engine: Engine, hooks: Settings) -> None:
    """Finding 3: while 2,000 deliveries are made, chunks of 100, another user's write (a job
    stored through a write scope, as the intake does) commits between two chunks, not after all."""
    many_subscriptions(engine, 2000)
    notifier = Notifier(engine, hooks.model_copy(update={"notify_fan_out_chunk": 100}))
    fanning = threading.Thread(target=lambda: [notifier.run_pass() for _ in range(4)], daemon=True)
    fanning.start()
    try:

        def started() -> bool:
            with session_scope(engine) as session:
                return count(session, Delivery) > 0

        wait_for(started, timeout=30, what="the first chunk")
        asked = time.monotonic()
        with write_scope(engine) as session:
            new_job(session, "bob")
            made_by_then = count(session, Delivery)
        waited = time.monotonic() - asked
        fanning.join(timeout=60)
    finally:
        notifier.stop()
    with session_scope(engine) as session:
        assert count(session, Delivery) == 2000 and count(session, Notice) == 0
    assert made_by_then < 2000, f"bob's write waited for the whole fan-out ({waited:.2f} s)"


def test_delivered_and_failed_deliveries_are_pruned_after_the_retention(
    engine: Engine, hooks: Settings
) -> None:
    """Finding 3: deliveries were never pruned. Pending ones stay, whatever their age."""
    old = utcnow() - timedelta(days=15)
    with session_scope(engine) as session:
        sub = subscribe(session, "alice", "http://127.0.0.1:9999/a").id or 0
        session.connection().execute(
            insert(Delivery),
            [
                delivery("alice", sub, "u", status="delivered", created_at=old, event="old.delivered"),
                delivery("alice", sub, "u", status="failed", created_at=old, event="old.failed"),
                delivery("alice", sub, "u", status="pending", created_at=old, event="old.pending"),
                delivery("alice", sub, "u", status="delivered", event="new.delivered"),
            ],
        )
    keeper = Housekeeper(engine, hooks.model_copy(update={"keep_deliveries_days": 14.0}))
    assert keeper.prune_deliveries() == 2
    assert sorted(d.event for d in rows_of(engine, "alice")) == ["new.delivered", "old.pending"]


def run_once(engine: Engine, settings: Settings) -> None:
    notifier = Notifier(engine, settings)
    try:
        notifier.run_pass()
        notifier.wait_idle()
    finally:
        notifier.stop()


def test_last_error_says_the_status_alone_never_the_body_or_a_location(
    engine: Engine, hooks: Settings, receiver: Receiver
) -> None:
    """Finding 5: an internal service's 403 body, or a token in a redirect's Location, came back to
    the subscriber in `last_error`."""
    receiver.answers[:] = [403, 302]
    with session_scope(engine) as session:
        subscribe(session, "alice", receiver.url)
        fail(session, new_job(session, "alice"))
    errors = []
    for _ in range(2):
        run_once(engine, hooks)
        (row,) = rows_of(engine, "alice")
        errors.append((row.last_status, row.last_error))
    assert errors == [(403, "HTTP 403"), (302, "HTTP 302: redirects are not followed")]
    assert all(TOKEN not in (error or "") for _, error in errors)


def test_the_connection_goes_to_the_address_that_was_checked(
    engine: Engine, hooks: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 5 (the DNS window): hooks.example.org resolves to 127.0.0.1 when checked and to
    127.0.0.2 at any later lookup; the POST must reach 127.0.0.1, with the name as its Host."""
    real = socket.getaddrinfo
    lookups: list[str] = []

    def getaddrinfo(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "hooks.example.org":
            return real(host, port, *args, **kwargs)
        lookups.append(host)
        address = "127.0.0.1" if len(lookups) == 1 else "127.0.0.2"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, int(port)))]

    with receiving() as checked, receiving(host="127.0.0.2", port=checked.port) as other:
        with session_scope(engine) as session:
            subscribe(session, "alice", checked.at("hooks.example.org"))
            fail(session, new_job(session, "alice"))
        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
        run_once(engine, hooks)
        monkeypatch.undo()
        assert other.all() == [], "connected to an address no check approved"
        (got,) = checked.taken()
    assert got.headers["host"] == f"hooks.example.org:{checked.port}" and lookups == ["hooks.example.org"]


def test_an_unlisted_port_is_refused_at_delivery_too(
    engine: Engine, hooks: Settings, receiver: Receiver
) -> None:
    """Finding 5: a subscription stored before the operator narrowed the ports is not sent."""
    with session_scope(engine) as session:
        subscribe(session, "alice", receiver.url)
        fail(session, new_job(session, "alice"))
    run_once(engine, hooks.model_copy(update={"webhook_ports": ["443"]}))
    (row,) = rows_of(engine, "alice")
    assert row.status == "failed" and row.last_error is not None
    assert f"port {receiver.port} is not among the ports webhooks may reach" in row.last_error
    assert receiver.all() == []


def test_a_send_tries_each_checked_address_in_turn(hooks: Settings) -> None:
    """Pinned, yet as a resolver's list is tried: 127.0.0.1 refuses, 127.0.0.2 (also checked) answers."""
    with receiving(host="127.0.0.2") as second:
        url = second.at("hooks.example.org")
        claimed = deliveries.Claimed(1, str(uuid.uuid4()), "alice", url, "job.failed", {}, 1, "s" * 64)
        limits = webhook_send.Limits(connect_s=1.0, read_s=1.0, total_s=DEADLINE_S)
        rules = notifications.rules_of(hooks)
        outcome = webhook_send.send(
            claimed,
            rules,
            limits,
            ssl.create_default_context(),
            lambda host, port: ["127.0.0.1", "127.0.0.2"],
        )
        assert outcome == deliveries.Outcome(True, status=200) and len(second.taken()) == 1


def test_https_to_the_checked_address_keeps_the_name_for_tls(hooks: Settings, tmp_path: Path) -> None:
    """Pinned to 127.0.0.1, the TLS server name (and so the certificate check) stays the URL's name:
    the receiver's certificate names hooks.example.org only."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=hooks.example.org",
         "-addext", "subjectAltName=DNS:hooks.example.org"],
        check=True, capture_output=True,
    )  # fmt: skip
    serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    serving.load_cert_chain(cert, key)
    trusting = ssl.create_default_context(cafile=str(cert))
    limits = webhook_send.Limits(connect_s=2.0, read_s=2.0, total_s=5.0)
    with receiving(tls=serving) as receiver:
        url = f"https://hooks.example.org:{receiver.port}/hook"
        claimed = deliveries.Claimed(1, str(uuid.uuid4()), "alice", url, "job.failed", {}, 1, "s" * 64)
        resolver = lambda host, port: ["127.0.0.1"]  # noqa: E731
        rules = notifications.rules_of(hooks)
        assert webhook_send.send(claimed, rules, limits, trusting, resolver).delivered
        (got,) = receiver.taken()
    assert got.headers["host"] == f"hooks.example.org:{receiver.port}"
