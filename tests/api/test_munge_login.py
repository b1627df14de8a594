"""`POST /api/v1/auth/munge`: logging in with credentials made by the real munged, as alice, bob and
root (runuser), and the ones refused: a replay, a forged one, one for another service, an expired
one. Needs munge and root (runuser); CI installs both (deploy/slurm/up.sh starts munged)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import Engine
from sqlmodel import select

from service.app import create_app
from service.config import Settings
from service.domain import login as login_domain
from service.domain.auth import TokenCheck, create_token, hash_token
from service.domain.munge import Decoded
from service.errors import Unauthenticated
from service.ledger.db import session_scope
from service.ledger.models.access import ApiToken
from tests.fakes import FakeBackend
from tests.support import bearer, issue_token

MUNGE = Path("/usr/bin/munge")
LOGIN = "/api/v1/auth/munge"
needs_munge = pytest.mark.skipif(
    not MUNGE.exists() or os.geteuid() != 0,
    reason="needs /usr/bin/munge and a running munged (deploy/slurm/up.sh), and root to make credentials "
    "as alice and bob (runuser)",
)


def credential(user: str, service: str, *, ttl: int = 0, nonce: str | None = None) -> str:
    """A credential made by `user` (root: this process), retried while munged restarts (up.sh)."""
    payload = json.dumps({"service": service, "nonce": nonce or secrets.token_urlsafe(24)})
    command = [str(MUNGE), "-t", str(ttl), "-s", payload]
    if user != "root":
        command = ["runuser", "-u", user, "--", *command]
    deadline = time.monotonic() + 20
    while True:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
        if done.returncode == 0 or time.monotonic() > deadline:
            assert done.returncode == 0, done.stderr
            return done.stdout.strip()
        time.sleep(0.5)


def post_login(api: TestClient, made: str) -> Any:
    """POST the credential; again while the service's munged restarts (503: nothing was decoded)."""
    deadline = time.monotonic() + 20
    while True:
        answer = api.post(LOGIN, json={"credential": made})
        if answer.status_code != 503 or time.monotonic() > deadline:
            return answer
        time.sleep(0.5)


def message(response: Any) -> str:
    return " ".join(str(item["msg"]) for item in response.json()["detail"])


@pytest.fixture
def munge_api(settings: Settings, fake: FakeBackend) -> Iterator[TestClient]:
    settings = settings.model_copy(update={"admin_groups": ["bob"], "max_failed_logins": 4})
    app = create_app(settings, backends={"local": fake, "slurm": FakeBackend()})
    with TestClient(app) as client:
        yield client


def service_id(api: TestClient) -> str:
    answer = api.get("/api/v1/auth/service")
    assert answer.status_code == 200, answer.text
    return str(answer.json()["service_id"])


@needs_munge
def test_a_first_login_makes_the_user_of_the_account_with_a_token_that_expires(munge_api: TestClient) -> None:
    answer = post_login(munge_api, credential("alice", service_id(munge_api)))

    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["user"], body["unix_user"]) == ("alice", "alice")
    assert body["token"].startswith("ty_")
    me = munge_api.get("/api/v1/whoami", headers=bearer(body["token"]))
    assert me.json() == {"user": "alice", "admin": False}
    engine: Engine = munge_api.app.state.runtime.engine  # type: ignore[attr-defined]
    audit = munge_api.get("/api/v1/audit", headers=bearer(issue_token(engine, "root", admin=True))).json()
    assert {"user.create", "login", "token.create"} <= {entry["action"] for entry in audit}
    again = post_login(munge_api, credential("alice", service_id(munge_api)))
    assert again.status_code == 200 and again.json()["token"] != body["token"]
    creates = munge_api.get("/api/v1/audit", headers=bearer(issue_token(engine, "root", admin=True))).json()
    assert [entry["action"] for entry in creates].count("user.create") == 1


@needs_munge
def test_a_member_of_an_admin_group_logs_in_as_an_admin(munge_api: TestClient) -> None:
    answer = post_login(munge_api, credential("bob", service_id(munge_api)))

    assert answer.status_code == 200, answer.text
    me = munge_api.get("/api/v1/whoami", headers=bearer(answer.json()["token"]))
    assert me.json() == {"user": "bob", "admin": True}


@needs_munge
def test_root_may_not_log_in(munge_api: TestClient) -> None:
    answer = post_login(munge_api, credential("root", service_id(munge_api)))

    assert answer.status_code == 403, answer.text
    assert "root may not log in" in message(answer)
    engine: Engine = munge_api.app.state.runtime.engine  # type: ignore[attr-defined]
    audit = munge_api.get("/api/v1/audit", headers=bearer(issue_token(engine, "admin", admin=True))).json()
    (refusal,) = [entry for entry in audit if entry["action"] == "login.refused"]
    assert refusal["actor"] == "uid 0" and "root may not log in" in refusal["detail"]


@needs_munge
def test_an_account_below_the_lowest_login_uid_is_refused(settings: Settings, fake: FakeBackend) -> None:
    settings = settings.model_copy(update={"min_login_uid": 1002})
    with TestClient(create_app(settings, backends={"local": fake, "slurm": FakeBackend()})) as api:
        answer = post_login(api, credential("alice", service_id(api)))

    assert answer.status_code == 403, answer.text
    assert "below TORCHYARD_MIN_LOGIN_UID" in message(answer)


@needs_munge
def test_a_credential_logs_in_once(munge_api: TestClient) -> None:
    made = credential("alice", service_id(munge_api))
    first = post_login(munge_api, made)
    replay = post_login(munge_api, made)

    assert first.status_code == 200, first.text
    assert replay.status_code == 401, replay.text
    assert "used before (a replay)" in message(replay)


def test_the_ledger_remembers_a_nonce_whoever_decodes_it(engine: Engine) -> None:
    """munged refuses a replay it decoded itself; the ledger refuses one after munged restarted, or
    decoded by another replica's munged: the same decoded credential, twice."""
    decoded = Decoded(1001, 1001, int(time.time()), 300, b"")
    with session_scope(engine) as session:
        login_domain._remember(session, "n" * 20, decoded)
    with session_scope(engine) as session, pytest.raises(Unauthenticated, match="replay"):
        login_domain._remember(session, "n" * 20, decoded)
    expired = Decoded(1001, 1001, int(time.time()) - 1000, 300, b"")
    with session_scope(engine) as session:  # an expired one is let go of: no replay of it can decode
        login_domain._remember(session, "m" * 20, expired)
        login_domain._remember(session, "o" * 20, decoded)
    with session_scope(engine) as session:
        login_domain._remember(session, "m" * 20, decoded)


@needs_munge
def test_a_forged_credential_is_refused(munge_api: TestClient) -> None:
    made = credential("alice", service_id(munge_api))
    middle = len(made) // 2
    forged = made[:middle] + ("A" if made[middle] != "A" else "B") + made[middle + 1 :]
    answer = post_login(munge_api, forged)

    assert answer.status_code == 401, answer.text
    assert "not valid" in message(answer)


@needs_munge
def test_a_credential_made_for_another_service_is_refused(munge_api: TestClient) -> None:
    answer = post_login(munge_api, credential("alice", "torchyard-elsewhere"))

    assert answer.status_code == 401, answer.text
    assert "made for another service" in message(answer)


@needs_munge
def test_an_expired_credential_is_refused(munge_api: TestClient) -> None:
    made = credential("alice", service_id(munge_api), ttl=1)
    time.sleep(2.5)
    answer = post_login(munge_api, made)

    assert answer.status_code == 401, answer.text
    assert "expired" in message(answer)


@needs_munge
def test_failed_logins_from_one_source_are_limited(munge_api: TestClient) -> None:
    for _ in range(4):
        refused = post_login(munge_api, "MUNGE:not-a-credential:")
        assert refused.status_code == 401, refused.text
    limited = post_login(munge_api, credential("alice", service_id(munge_api)))

    assert limited.status_code == 429, limited.text
    assert "too many failed logins" in message(limited) and int(limited.headers["Retry-After"]) > 0


@needs_munge
def test_a_login_token_is_refused_once_it_expires(munge_api: TestClient) -> None:
    body = post_login(munge_api, credential("alice", service_id(munge_api))).json()
    hours = (datetime.fromisoformat(body["expires_at"]) - datetime.now(timezone.utc)).total_seconds() / 3600
    fresh = munge_api.get("/api/v1/whoami", headers=bearer(body["token"]))
    runtime = munge_api.app.state.runtime  # type: ignore[attr-defined]
    with session_scope(runtime.engine) as session:
        row = session.exec(select(ApiToken).where(ApiToken.token_hash == hash_token(body["token"]))).one()
        row.expires_at = datetime.now(timezone.utc) - timedelta(seconds=1)
    runtime.tokens._known.clear()  # what the token cache held a moment ago
    stale = munge_api.get("/api/v1/whoami", headers=bearer(body["token"]))

    assert 167.9 < hours <= 168  # TORCHYARD_LOGIN_TOKEN_HOURS
    assert fresh.status_code == 200, fresh.text
    assert stale.status_code == 401 and "has expired" in message(stale)


def test_a_remembered_token_is_refused_once_it_expires(engine: Engine) -> None:
    """The token cache keeps the expiry with the answer: no lookup is needed to refuse it then."""
    with session_scope(engine) as session:
        raw = create_token(session, "carol", expires_at=datetime.now(timezone.utc) + timedelta(seconds=2))
    check = TokenCheck(engine, ttl_s=60)
    assert check.lookup(raw).user == "carol"
    time.sleep(2.1)
    with pytest.raises(Unauthenticated, match="has expired"):
        check.cached(raw)
    with pytest.raises(Unauthenticated, match="has expired"):
        check.lookup(raw)


@needs_munge
def test_a_user_name_mapped_to_another_account_is_not_taken_over(munge_api: TestClient) -> None:
    engine: Engine = munge_api.app.state.runtime.engine  # type: ignore[attr-defined]
    issue_token(engine, "alice", unix_user="bob")  # the operator's alice runs as bob
    answer = post_login(munge_api, credential("alice", service_id(munge_api)))

    assert answer.status_code == 403, answer.text
    assert "runs jobs as another account" in message(answer)


def test_a_credential_too_long_is_a_422_naming_it(munge_api: TestClient) -> None:
    answer = post_login(munge_api, "x" * 5000)

    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"] == ["body", "credential"]
