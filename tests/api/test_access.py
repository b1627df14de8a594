"""Who may get in, and what they may see: tokens, ownership (404 for others' jobs), admins, dev mode,
the audit log. Real tokens in a real ledger; the backends are fakes."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from service.app import create_app
from service.config import Settings
from service.domain import auth
from service.ledger.db import session_scope
from service.ledger.models.access import ApiToken
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import JOBS, bearer, runtime_of, submit, wait_state

BODY: dict[str, Any] = {"name": "mine", "entrypoint": "worker.tasks.seed:ddp_step"}
PROTECTED = [
    ("GET", JOBS),
    ("POST", JOBS),
    ("GET", f"{JOBS}/1"),
    ("GET", f"{JOBS}/1/events"),
    ("GET", f"{JOBS}/1/metrics"),
    ("GET", f"{JOBS}/1/logs"),
    ("POST", f"{JOBS}/1/cancel"),
    ("GET", "/api/v1/whoami"),
    ("GET", "/api/v1/audit"),
    ("GET", "/metrics"),
]


def message(response: Any) -> str:
    return " ".join(str(item["msg"]) for item in response.json()["detail"])


# ---------------------------------------------------------------- authentication


@pytest.mark.parametrize(("method", "path"), PROTECTED)
def test_every_endpoint_but_health_and_the_dashboard_needs_a_token(
    api: TestClient, method: str, path: str
) -> None:
    no_token = api.request(method, path, headers={"Authorization": ""}, json=BODY)
    wrong = api.request(method, path, headers=bearer("ty_made-up"), json=BODY)
    not_bearer = api.request(method, path, headers={"Authorization": "Basic YWxpY2U6eA=="}, json=BODY)

    for response in (no_token, wrong, not_bearer):
        assert response.status_code == 401, (method, path, response.text)
        assert response.headers["WWW-Authenticate"] == "Bearer"
    assert "Bearer <token>" in message(no_token)
    assert "not valid" in message(wrong)
    assert "must be 'Bearer <token>'" in message(not_bearer)


def test_health_and_the_dashboard_answer_without_a_token(api: TestClient) -> None:
    assert api.get("/healthz", headers={"Authorization": ""}).status_code == 200
    page = api.get("/", headers={"Authorization": ""}, follow_redirects=True)
    assert page.status_code == 200 and "<html" in page.text.lower()


def test_tokens_are_stored_only_as_hashes(api: TestClient) -> None:
    raw = api.headers["Authorization"].removeprefix("Bearer ")
    with Session(runtime_of(api).engine) as session:
        rows = session.exec(select(ApiToken)).all()
    stored = [value for row in rows for value in row.model_dump().values()]
    assert raw not in stored
    assert auth.hash_token(raw) in stored
    assert all(not str(value).startswith(raw) for value in stored if value != raw[:10])


def test_a_fresh_service_with_no_tokens_says_how_to_make_the_first(settings: Settings) -> None:
    with TestClient(create_app(settings, backends={"local": FakeBackend("local")})) as client:
        response = client.get(JOBS, headers=bearer("ty_anything"))

    assert response.status_code == 401
    assert "torchyard token create --user NAME --admin" in message(response)


def test_a_revoked_token_stops_working(settings: Settings) -> None:
    fresh = settings.model_copy(update={"token_cache_s": 0.0})
    with TestClient(create_app(fresh, backends={"local": FakeBackend("local")})) as client:
        engine = client.app.state.runtime.engine  # type: ignore[attr-defined]
        with session_scope(engine) as session:
            raw = auth.create_token(session, "carol")
        assert client.get(JOBS, headers=bearer(raw)).status_code == 200
        with session_scope(engine) as session:
            [row] = [row for row in auth.list_tokens(session) if row.username == "carol"]
            auth.revoke_token(session, row.id or 0)
            auth.revoke_token(session, row.id or 0)  # idempotent

        response = client.get(JOBS, headers=bearer(raw))

    assert response.status_code == 401 and "revoked" in message(response)


def test_whoami_names_the_caller(api: TestClient, login: Login) -> None:
    assert api.get("/api/v1/whoami").json() == {"user": "alice", "admin": False}
    assert api.get("/api/v1/whoami", headers=login("root", admin=True)).json() == {
        "user": "root",
        "admin": True,
    }


# ---------------------------------------------------------------- ownership


def test_a_job_belongs_to_its_submitter_and_others_get_404(api: TestClient, login: Login) -> None:
    job = submit(api, **BODY)
    bob = login("bob")
    assert job["owner"] == "alice"

    for suffix in ("", "/events", "/metrics", "/logs"):
        response = api.get(f"{JOBS}/{job['id']}{suffix}", headers=bob)
        assert response.status_code == 404, suffix
        assert message(response) == f"job_id: job {job['id']} not found"  # the same as no job at all
    assert api.post(f"{JOBS}/{job['id']}/cancel", headers=bob).status_code == 404
    assert api.get(f"{JOBS}/{job['id']}").json()["state"] != "cancelled"
    assert api.get(JOBS, headers=bob).json()["items"] == []
    assert [item["id"] for item in api.get(JOBS).json()["items"]] == [job["id"]]


def test_an_admin_sees_and_cancels_everyones_jobs(api: TestClient, login: Login) -> None:
    mine = submit(api, **BODY)
    bobs = api.post(JOBS, json=BODY, headers=login("bob")).json()
    root = login("root", admin=True)
    wait_state(api, bobs["id"], "running", headers=root)

    listed = {item["id"]: item["owner"] for item in api.get(JOBS, headers=root).json()["items"]}
    cancelled = api.post(f"{JOBS}/{bobs['id']}/cancel", headers=root)

    assert listed == {mine["id"]: "alice", bobs["id"]: "bob"}
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"


def test_a_list_tag_from_one_user_does_not_answer_another_with_their_page(
    api: TestClient, login: Login
) -> None:
    job = submit(api, **BODY)
    wait_state(api, job["id"], "running")  # the ledger stays still from here on
    bob = login("bob")
    first = api.get(JOBS)

    same_user = api.get(JOBS, headers={"If-None-Match": first.headers["ETag"]})
    other_user = api.get(JOBS, headers={**bob, "If-None-Match": first.headers["ETag"]})

    assert first.headers["Vary"] == "Authorization"
    assert same_user.status_code == 304
    assert other_user.status_code == 200 and other_user.json()["items"] == []


# ---------------------------------------------------------------- the audit log


def test_the_audit_log_records_submit_cancel_and_tokens_and_only_admins_read_it(
    api: TestClient, login: Login, fake: FakeBackend
) -> None:
    job = submit(api, **BODY)
    wait_state(api, job["id"], "running")
    api.post(f"{JOBS}/{job['id']}/cancel")
    root = login("root", admin=True)

    refused = api.get("/api/v1/audit")
    entries = api.get("/api/v1/audit", headers=root).json()
    by_alice = api.get("/api/v1/audit", headers=root, params={"actor": "alice"}).json()

    assert refused.status_code == 403 and "admin" in message(refused)
    acts = [(e["actor"], e["action"], e["target"]) for e in entries]
    assert ("alice", "job.submit", f"job {job['id']}") in acts
    assert ("alice", "job.cancel", f"job {job['id']}") in acts
    assert sum(action == "token.create" for _, action, _ in acts) == 2  # alice's and root's
    assert [e["id"] for e in entries] == sorted((e["id"] for e in entries), reverse=True)
    assert {e["actor"] for e in by_alice} == {"alice"} and len(by_alice) == 2
    page = api.get("/api/v1/audit", headers=root, params={"limit": 1, "before_id": entries[0]["id"]})
    assert [e["id"] for e in page.json()] == [entries[1]["id"]]


# ---------------------------------------------------------------- dev mode


def test_dev_mode_needs_no_token_and_everyone_is_admin(settings: Settings) -> None:
    dev = settings.model_copy(update={"dev_mode": True})
    app = create_app(dev, backends={"local": FakeBackend("local")})
    # a caller on this machine, asking for it by a loopback name
    with TestClient(app, base_url="http://127.0.0.1:8321", client=("127.0.0.1", 50000)) as client:
        created = client.post(JOBS, json=BODY)
        whoami = client.get("/api/v1/whoami").json()

    assert created.status_code == 201 and created.json()["owner"] == "dev"
    assert whoami == {"user": "dev", "admin": True}


def test_dev_mode_refuses_to_listen_beyond_this_machine(settings: Settings) -> None:
    with pytest.raises(ValueError, match="dev mode"):
        create_app(settings.model_copy(update={"dev_mode": True, "host": "0.0.0.0"}))


def test_dev_mode_answers_no_caller_from_elsewhere(settings: Settings) -> None:
    dev = settings.model_copy(update={"dev_mode": True})
    app = create_app(dev, backends={"local": FakeBackend("local")})
    with TestClient(app, client=("192.0.2.7", 4242)) as client:
        response = client.get(JOBS)

    assert response.status_code == 403 and "only this machine" in message(response)
