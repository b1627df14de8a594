"""/api/v1/notifications: subscriptions (made, listed, read with their secret, removed; the host lists
checked), a spec's `notify`, and deliveries of a job's states to a real receiver on 127.0.0.1."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import service.cli.context as cli_context
from service.cli.context import EXIT_REQUEST
from service.cli.main import app
from service.client import TorchyardClient
from service.config import Settings
from service.domain import webhook_events
from service.states import JobState
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import submit, wait_for, wait_state
from tests.webhook_receiver import Receiver, receiving

SUBSCRIPTIONS = "/api/v1/notifications/subscriptions"
DELIVERIES = "/api/v1/notifications/deliveries"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    """Webhooks to 127.0.0.1 allowed, as an operator names an internal receiver; quick passes."""
    return settings.model_copy(
        update={
            "webhook_hosts": ["127.0.0.1", "hooks.example.org"],
            "webhook_private_hosts": ["127.0.0.1"],
            "webhook_ports": ["1024-65535"],  # the receivers' free ports; 9 is refused
            "notify_interval_s": 0.05,
            "webhook_backoff_s": 0.05,
            "webhook_max_attempts": 3,
            "public_url": "https://torchyard.example.org/",
        }
    )


@pytest.fixture
def receiver() -> Any:
    with receiving() as one:
        yield one


def subscribe(api: TestClient, **body: Any) -> dict[str, Any]:
    response = api.post(SUBSCRIPTIONS, json=body)
    assert response.status_code == 201, response.text
    made: dict[str, Any] = response.json()
    return made


def deliveries(api: TestClient, **params: Any) -> list[dict[str, Any]]:
    response = api.get(DELIVERIES, params=params)
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()
    return found


def test_a_failed_job_is_told_signed_once(api: TestClient, fake: FakeBackend, receiver: Receiver) -> None:
    made = subscribe(api, url=receiver.url, on=["failed", "succeeded"])
    assert len(made["secret"]) == 64 and made["on"] == ["failed", "succeeded"]
    job_id = submit(api, name="train")["id"]
    wait_state(api, job_id, "running")
    fake.set_status(job_id, JobState.failed, "rank 0 raised ValueError\ntraceback...", 1)
    wait_state(api, job_id, "failed")

    (got,) = wait_for(lambda: receiver.taken() or None, what="the delivery")
    assert webhook_events.verify(made["secret"], got.body, got.headers["x-torchyard-signature"])
    assert got.headers["x-torchyard-event"] == "job.failed"
    assert got.headers["content-type"] == "application/json"
    event = got.json
    assert event["delivery_id"] == got.headers["x-torchyard-delivery"]
    assert event["job"]["id"] == job_id and event["job"]["state"] == "failed"
    assert event["job"]["owner"] == "alice" and event["job"]["attempt"] == 1
    assert event["job"]["url"] == f"https://torchyard.example.org/#/jobs/{job_id}"
    assert event["text"] == (
        f'job {job_id} "train" failed: rank 0 raised ValueError https://torchyard.example.org/#/jobs/{job_id}'
    )
    (row,) = wait_for(lambda: [d for d in deliveries(api, job=job_id) if d["status"] == "delivered"] or None)
    assert row["delivery_id"] == event["delivery_id"] and row["attempts"] == 1 and row["last_status"] == 200
    assert len(receiver.all()) == 1  # running was not asked for


def test_a_failing_receiver_is_tried_again_then_given_up(
    api: TestClient, fake: FakeBackend, receiver: Receiver
) -> None:
    receiver.answers[:] = [500, 302, 503, 500]
    subscribe(api, url=receiver.url, on=["ended"])
    first = submit(api)["id"]
    wait_state(api, first, "running")
    fake.set_status(first, JobState.succeeded, "completed", 0)

    (row,) = wait_for(lambda: [d for d in deliveries(api) if d["status"] == "failed"] or None)
    assert row["attempts"] == 3 and row["last_status"] == 503
    assert [one.headers["x-answered"] for one in receiver.all()] == ["500", "302", "503"]
    assert len({one.headers["x-torchyard-delivery"] for one in receiver.all()}) == 1  # one delivery id

    second = submit(api)["id"]  # the receiver is answering 500 once more, then 200
    wait_state(api, second, "running")
    fake.set_status(second, JobState.succeeded, "completed", 0)
    (done,) = wait_for(lambda: deliveries(api, job=second, status="delivered") or None)
    assert done["attempts"] == 2 and done["last_error"] is None


def test_subscriptions_are_their_owners(api: TestClient, login: Login, receiver: Receiver) -> None:
    made = subscribe(api, url=receiver.url, on=["failed"], secret="s3cret-of-alice-0001")
    assert made["secret"] == "s3cret-of-alice-0001"
    bob = login("bob")
    root = login("root", admin=True)

    assert [one["id"] for one in api.get(SUBSCRIPTIONS).json()] == [made["id"]]
    assert "secret" not in api.get(SUBSCRIPTIONS).json()[0]
    assert api.get(f"{SUBSCRIPTIONS}/{made['id']}").json()["secret"] == made["secret"]
    assert api.get(SUBSCRIPTIONS, headers=bob).json() == []
    for headers in (bob, root):
        assert api.get(f"{SUBSCRIPTIONS}/{made['id']}", headers=headers).status_code == 404
        assert api.delete(f"{SUBSCRIPTIONS}/{made['id']}", headers=headers).status_code == 404

    alices_job = submit(api, name="x")["id"]
    assert api.get(DELIVERIES, params={"job": alices_job}, headers=bob).status_code == 404
    body = {"url": receiver.url, "on": ["failed"], "job": alices_job}
    response = api.post(SUBSCRIPTIONS, json=body, headers=bob)
    assert response.status_code == 404 and response.json()["detail"][0]["loc"] == ["body", "job"]

    removed = api.delete(f"{SUBSCRIPTIONS}/{made['id']}")
    assert (
        removed.status_code == 200 and removed.json()["id"] == made["id"] and "secret" not in removed.json()
    )
    assert api.get(f"{SUBSCRIPTIONS}/{made['id']}").status_code == 404


@pytest.mark.parametrize(
    ("body", "loc", "words"),
    [
        ({"on": ["failed", "exploded"]}, ["body", "on", "1"], "'exploded' is not a state"),
        # states no notice is written for: such a subscription would never be told anything
        ({"on": ["queued"]}, ["body", "on", "0"], "'queued' is never told"),
        ({"on": ["ended", "waiting"]}, ["body", "on", "1"], "'waiting' is never told"),
        ({"on": ["submitted"]}, ["body", "on", "0"], "'submitted' is never told"),
        ({"on": ["pending"]}, ["body", "on", "0"], "'pending' is never told"),
        # only listed ports (by default 80 and 443): no probing what else listens on an allowed host
        ({"url": "http://127.0.0.1:9/hook"}, ["body", "url"], "port 9 is not among the ports"),
        ({"url": "http://127.0.0.1:22/hook"}, ["body", "url"], "TORCHYARD_WEBHOOK_PORTS"),
        ({"url": "http://127.0.0.2:9/hook"}, ["body", "url"], "not among the hosts"),
        ({"url": "http://evil.example.com/hook"}, ["body", "url"], "not among the hosts"),
        ({"url": "ftp://127.0.0.1/hook"}, ["body", "url"], "http:// or https://"),
        ({"url": "http://u:p@127.0.0.1/hook"}, ["body", "url"], "user name or password"),
        ({"job": 1, "pipeline": 1}, ["body", "pipeline"], "not both"),
        ({"pipeline": 99}, ["body", "pipeline"], "not found"),
    ],
)
def test_bad_subscriptions_are_refused_naming_the_field(
    api: TestClient, body: dict[str, Any], loc: list[str], words: str
) -> None:
    response = api.post(SUBSCRIPTIONS, json={"url": "http://127.0.0.1:9999/hook", "on": ["failed"], **body})
    assert response.status_code in (404, 422), response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == loc and words in detail["msg"], detail


def test_a_spec_notify_becomes_a_subscription_of_the_job(
    api: TestClient, fake: FakeBackend, receiver: Receiver
) -> None:
    earlier = subscribe(api, url=receiver.url, on=["cancelled"], secret="one-secret-per-url-0001")
    job = submit(api, notify=[{"url": receiver.url, "on": ["succeeded"]}])
    assert "notify" not in job["spec"]  # not the ranks' business
    mine = [one for one in api.get(SUBSCRIPTIONS).json() if one["job_id"] == job["id"]]
    assert [one["on"] for one in mine] == [["succeeded"]]
    assert api.get(f"{SUBSCRIPTIONS}/{mine[0]['id']}").json()["secret"] == earlier["secret"]
    wait_state(api, job["id"], "running")
    fake.finish(job["id"], 1)
    (got,) = wait_for(lambda: receiver.taken() or None, what="the delivery")
    assert got.json["event"] == "job.succeeded"
    assert webhook_events.verify(earlier["secret"], got.body, got.headers["x-torchyard-signature"])

    notify = [{"url": "http://10.0.0.1/x", "on": ["failed"]}]
    refused = api.post(
        "/api/v1/jobs", json={"name": "x", "entrypoint": "worker.tasks.seed:ddp_step", "notify": notify}
    )
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["loc"] == ["body", "notify", "0.url"]


def test_webhooks_off_until_the_operator_names_hosts(api: TestClient) -> None:
    runtime_settings = api.app.state.runtime.settings  # type: ignore[attr-defined]
    runtime_settings.webhook_hosts = []
    response = api.post(SUBSCRIPTIONS, json={"url": "http://127.0.0.1:9/hook", "on": ["failed"]})
    assert response.status_code == 422
    assert "TORCHYARD_WEBHOOK_HOSTS" in response.json()["detail"][0]["msg"]


def test_the_notify_verbs(api: TestClient, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """`torchyard notify add/list/deliveries/rm` through the typed client, against this service."""
    token = api.headers["authorization"].removeprefix("Bearer ")
    real = TorchyardClient

    def client(base_url: str | None = None, token: str | None = None, **kwargs: Any) -> TorchyardClient:
        return real("http://testserver", token=token, transport=api._transport)

    monkeypatch.setattr(cli_context, "TorchyardClient", client)
    runner = CliRunner()

    def run(*args: str) -> str:
        done = runner.invoke(app, ["--token", token, "notify", *args])
        assert done.exit_code == 0, done.output
        return done.output

    added = run("add", receiver.url, "--on", "failed,succeeded")
    (sub_id,) = [
        int(line.split()[1].rstrip(":")) for line in added.splitlines() if line.startswith("subscription")
    ]
    secret = api.get(f"{SUBSCRIPTIONS}/{sub_id}").json()["secret"]
    assert f"secret: {secret}" in added
    assert receiver.url in run("list")
    assert json.loads(run("deliveries", "--json")) == []
    refused = runner.invoke(app, ["--token", token, "notify", "add", "http://10.0.0.1/x", "--on", "failed"])
    assert refused.exit_code == EXIT_REQUEST and "not among the hosts" in refused.output
    assert f"removed subscription {sub_id}" in run("rm", str(sub_id))
    assert "no subscriptions" in run("list")


def test_subscriptions_are_capped_per_user_and_per_job(api: TestClient, receiver: Receiver) -> None:
    """Finding 3: subscriptions were unbounded (2,000 made in 9.4 s, each told of every job)."""
    settings = api.app.state.runtime.settings  # type: ignore[attr-defined]
    settings.max_subscriptions_per_user, settings.max_subscriptions_per_job = 2, 1
    for _ in range(2):
        subscribe(api, url=receiver.url, on=["failed"])
    over = api.post(SUBSCRIPTIONS, json={"url": receiver.url, "on": ["failed"]})
    assert over.status_code == 409, over.text
    assert "TORCHYARD_MAX_SUBSCRIPTIONS_PER_USER=2" in over.json()["detail"][0]["msg"]

    job = submit(api)["id"]  # one bound to a job counts against the job's cap, not the user's
    subscribe(api, url=receiver.url, on=["failed"], job=job)
    again = api.post(SUBSCRIPTIONS, json={"url": receiver.url, "on": ["failed"], "job": job})
    assert again.status_code == 409 and again.json()["detail"][0]["loc"] == ["body", "job"]
    assert "TORCHYARD_MAX_SUBSCRIPTIONS_PER_JOB=1" in again.json()["detail"][0]["msg"]

    notify = [{"url": receiver.url, "on": ["failed"]}] * 2
    body = {"name": "x", "entrypoint": "worker.tasks.seed:ddp_step", "notify": notify}
    refused = api.post("/api/v1/jobs", json=body)
    assert refused.status_code == 409 and refused.json()["detail"][0]["loc"] == ["body", "notify"]


def test_retry_from_keeps_the_stages_webhooks(api: TestClient, fake: FakeBackend, receiver: Receiver) -> None:
    """Finding 9: `pipeline retry --from` made the stage's new job without its `notify`."""
    notify = [{"url": receiver.url, "on": ["succeeded", "failed"]}]
    body = {"name": "p", "stages": [{"name": "train", "job": {"entrypoint": "worker.tasks.seed:ddp_step",
                                                              "notify": notify}}]}  # fmt: skip
    made = api.post("/api/v1/pipelines", json=body)
    assert made.status_code == 201, made.text
    pipeline, first = made.json()["id"], made.json()["stages"][0]["job_id"]
    wait_state(api, first, "running")
    fake.set_status(first, JobState.failed, "boom", 1)
    wait_for(lambda: api.get(f"/api/v1/pipelines/{pipeline}").json()["state"] == "failed")
    again = api.post(f"/api/v1/pipelines/{pipeline}/retry", json={"from": "train"})
    assert again.status_code == 200, again.text
    second = again.json()["stages"][0]["job_id"]
    bound = {one["job_id"]: one["on"] for one in api.get(SUBSCRIPTIONS).json()}
    assert bound == {first: ["succeeded", "failed"], second: ["succeeded", "failed"]}


@pytest.mark.parametrize(
    ("method", "path"),
    [("get", "/api/v1/pipelines/999"), ("post", "/api/v1/pipelines/999/cancel")],
)
def test_a_missing_pipeline_names_the_path_parameter(api: TestClient, method: str, path: str) -> None:
    """Finding 9: these 404s named `body.pipeline_id`, a path parameter (as jobs' name `job_id`)."""
    response = api.request(method, path)
    assert response.status_code == 404
    assert response.json()["detail"][0]["loc"] == ["pipeline_id"]
    retry = api.post("/api/v1/pipelines/999/retry", json={"from": "x"})
    assert retry.status_code == 404 and retry.json()["detail"][0]["loc"] == ["pipeline_id"]
