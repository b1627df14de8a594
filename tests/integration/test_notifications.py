"""Webhooks end to end: real service processes running real local jobs, and a real HTTP receiver on
127.0.0.1 (tests/webhook_receiver.py) that checks every signature.

- a receiver that answers 500 twice gets the event on the third try, signed, and the service shows
  the three attempts (GET /api/v1/notifications/deliveries);
- a service SIGKILLed after a job's ending committed, before its delivery, delivers it once after
  its restart (the outbox);
- two replicas on one PostgreSQL ledger deliver each event once (the lease);
- a URL to 127.0.0.1 the operator did not name as private, or to a host not listed, is refused (422).
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from service.domain import webhook_events
from tests.integration.slurm.conftest import Api, ServiceProcess, ledger_token, service_env
from tests.support import PostgresServer, wait_for
from tests.webhook_receiver import Receiver, receiving

pytestmark = pytest.mark.integration

SUBSCRIPTIONS = "/api/v1/notifications/subscriptions"
DELIVERIES = "/api/v1/notifications/deliveries"
HOOKS = {
    "webhook_hosts": "127.0.0.1,hooks.example.org",
    "webhook_private_hosts": "127.0.0.1",
    "webhook_ports": "1024-65535",  # the receivers' free ports
    "notify_interval_s": "0.2",
    "webhook_backoff_s": "0.3",
    "backends": "local",
    "local_reconcile_interval_s": "0.1",
}
QUICK = {"entrypoint": "worker.tasks.faults:sleep", "kwargs": {"seconds": 0.1}}
FAILS = {"entrypoint": "worker.tasks.faults:raise_on_rank", "kwargs": {"rank": 0, "message": "bad batch"}}


def sqlite_service(tmp_path: Path, **settings: str) -> tuple[dict[str, str], str]:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    return service_env(tmp_path / "data", url, **{**HOOKS, **settings}), ledger_token(url)


def subscribe(api: Api, receiver: Receiver, on: list[str]) -> dict[str, Any]:
    response = api.post(SUBSCRIPTIONS, {"url": receiver.url, "on": on})
    assert response.status_code == 201, response.text
    made: dict[str, Any] = response.json()
    return made


def check_signed(receiver: Receiver, secret: str) -> None:
    for one in receiver.all():
        assert webhook_events.verify(secret, one.body, one.headers["x-torchyard-signature"]), one
        assert one.json["delivery_id"] == one.headers["x-torchyard-delivery"]


def test_a_receiver_that_answers_500_twice_gets_the_event_on_the_third_try(tmp_path: Path) -> None:
    env, token = sqlite_service(tmp_path)
    service = ServiceProcess(env, tmp_path / "service.log")
    try:
        api = Api(service.url, token)
        with receiving([500, 500]) as receiver:
            secret = subscribe(api, receiver, ["failed"])["secret"]
            job = api.submit(name="train", **FAILS)
            assert api.finished(job["id"])["state"] == "failed"
            wait_for(lambda: len(receiver.taken()) == 1 or None, 60, "the third try")
            assert [one.headers["x-answered"] for one in receiver.all()] == ["500", "500", "200"]
            check_signed(receiver, secret)
            assert len({one.headers["x-torchyard-delivery"] for one in receiver.all()}) == 1
            event = receiver.taken()[0].json
            assert event["event"] == "job.failed" and event["job"]["id"] == job["id"]
            assert "bad batch" in event["job"]["reason"] and event["text"].startswith(
                f'job {job["id"]} "train"'
            )
            (row,) = api.get(DELIVERIES, job=job["id"]).raise_for_status().json()
            assert (row["status"], row["attempts"], row["last_status"]) == ("delivered", 3, 200)
    finally:
        service.stop()


def test_a_service_killed_before_delivery_delivers_once_after_restart(tmp_path: Path) -> None:
    # The first service's notify loop passes once, at its start, then not for an hour: the job's
    # ending is committed (with its notice) and nothing is sent before the SIGKILL.
    env, token = sqlite_service(tmp_path)
    first = ServiceProcess({**env, "TORCHYARD_NOTIFY_INTERVAL_S": "3600"}, tmp_path / "first.log")
    with receiving() as receiver:
        try:
            api = Api(first.url, token)
            secret = subscribe(api, receiver, ["succeeded"])["secret"]
            job = api.submit(name="quick", **QUICK)
            assert api.finished(job["id"])["state"] == "succeeded"
            assert api.get(DELIVERIES).json() == [] and receiver.all() == []
        finally:
            first.kill()
        second = ServiceProcess(env, tmp_path / "second.log")
        try:
            wait_for(lambda: receiver.taken() or None, 60, "the delivery after the restart")
            time.sleep(1.5)  # several passes more: nothing is sent twice
            assert len(receiver.all()) == 1
            check_signed(receiver, secret)
            assert receiver.all()[0].json["job"]["id"] == job["id"]
            rows = Api(second.url, token).get(DELIVERIES).json()
            assert [(r["status"], r["attempts"]) for r in rows] == [("delivered", 1)]
        finally:
            second.stop()


@pytest.mark.postgres
def test_two_replicas_on_postgres_deliver_each_event_once(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = postgres_server.reset_ledger()
    env = service_env(tmp_path / "data", url, **{**HOOKS, "notify_interval_s": "0.05"})
    token = ledger_token(url)
    replicas = [ServiceProcess(env, tmp_path / f"{name}.log", cwd=tmp_path / name) for name in ("a", "b")]
    try:
        apis = [Api(replica.url, token) for replica in replicas]
        with receiving() as receiver:
            secret = subscribe(apis[0], receiver, ["running", "ended"])["secret"]
            jobs = [apis[n % 2].submit(name=f"j{n}", **QUICK) for n in range(4)]
            for job in jobs:
                assert apis[0].finished(job["id"])["state"] == "succeeded"
            wait_for(lambda: len(receiver.all()) >= 8 or None, 60, "8 events")
            time.sleep(1.0)  # many passes of both replicas more
            received = receiver.all()
            ids = Counter(one.headers["x-torchyard-delivery"] for one in received)
            assert len(received) == 8 and set(ids.values()) == {1}, ids
            assert Counter((one.json["job"]["id"], one.json["event"]) for one in received) == Counter(
                {(job["id"], event): 1 for job in jobs for event in ("job.running", "job.succeeded")}
            )
            check_signed(receiver, secret)
            rows = apis[1].get(DELIVERIES).json()
            assert sorted((r["status"], r["attempts"]) for r in rows) == [("delivered", 1)] * 8
    finally:
        for replica in replicas:
            replica.stop()


def test_loopback_and_unlisted_hosts_are_refused(tmp_path: Path) -> None:
    env, token = sqlite_service(tmp_path, webhook_private_hosts="")
    service = ServiceProcess(env, tmp_path / "service.log")
    try:
        api = Api(service.url, token)
        for url, words in [
            ("http://127.0.0.1:9999/hook", "127.0.0.1 resolves to 127.0.0.1, a loopback address"),
            ("https://evil.example.com/hook", "not among the hosts webhooks may reach"),
            ("http://localhost:9999/hook", "not among the hosts webhooks may reach"),
            ("http://127.0.0.1:9/hook", "port 9 is not among the ports webhooks may reach"),
        ]:
            response = api.post(SUBSCRIPTIONS, {"url": url, "on": ["failed"]})
            assert response.status_code == 422, response.text
            (detail,) = response.json()["detail"]
            assert detail["loc"] == ["body", "url"] and words in detail["msg"], detail
        spec = {"name": "x", **QUICK, "notify": [{"url": "http://127.0.0.1:9999/hook"}]}
        assert api.post("/api/v1/jobs", spec).status_code == 422
    finally:
        service.stop()
