"""`POST /api/v1/auth/ldap`: signing in with a user name and password checked by a real slapd
(tests.slapd: alice, bob, the LDAP group yard-admins), and the refusals: a wrong password, an unknown
user (the same words), an injection in the user name, an empty password, too many failures, no LDAP."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy.engine import Engine

from service.app import create_app
from service.config import Settings
from service.domain import ldap_login
from service.domain.login import LoginGuard
from service.errors import InvalidRequest, Unauthenticated
from tests.fakes import FakeBackend
from tests.slapd import (
    ADMIN_GROUP,
    GROUP_BASE,
    PASSWORDS,
    ROOT_DN,
    ROOT_PASSWORD,
    SUFFIX,
    USER_DN,
    SlapdServer,
    free_port,
)
from tests.support import bearer, issue_token

SIGN_IN = "/api/v1/auth/ldap"


def ldap_settings(settings: Settings, url: str) -> Settings:
    return settings.model_copy(
        update={
            "ldap_url": url,
            "ldap_user_dn": USER_DN,
            "ldap_group_base": GROUP_BASE,
            "admin_groups": [ADMIN_GROUP],  # an LDAP group only: the host has no such group
            "max_failed_logins": 4,
        }
    )


@pytest.fixture
def ldap_api(settings: Settings, fake: FakeBackend, slapd_server: SlapdServer) -> Iterator[TestClient]:
    app = create_app(
        ldap_settings(settings, slapd_server.url), backends={"local": fake, "slurm": FakeBackend()}
    )
    with TestClient(app) as client:
        yield client


def audit_of(api: TestClient) -> list[dict[str, Any]]:
    engine: Engine = api.app.state.runtime.engine  # type: ignore[attr-defined]
    answer = api.get("/api/v1/audit", headers=bearer(issue_token(engine, "root", admin=True)))
    assert answer.status_code == 200, answer.text
    return list(answer.json())


def test_a_good_password_signs_in_as_the_account_with_a_token_that_expires(ldap_api: TestClient) -> None:
    answer = ldap_api.post(SIGN_IN, json={"user": "alice", "password": PASSWORDS["alice"]})

    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["user"], body["unix_user"]) == ("alice", "alice")
    assert body["token"].startswith("ty_") and body["expires_at"]
    me = ldap_api.get("/api/v1/whoami", headers=bearer(body["token"]))
    assert me.json() == {"user": "alice", "admin": False}
    tokens = ldap_api.get("/api/v1/tokens", headers=bearer(body["token"]))
    assert tokens.status_code == 200, tokens.text
    assert [token["via"] for token in tokens.json()] == ["ldap"]
    logins = [entry for entry in audit_of(ldap_api) if entry["action"] == "login"]
    assert [entry["detail"].split()[0] for entry in logins] == ["via=ldap"]


def test_a_member_of_an_ldap_admin_group_signs_in_as_an_admin(ldap_api: TestClient) -> None:
    answer = ldap_api.post(SIGN_IN, json={"user": "bob", "password": PASSWORDS["bob"]})

    assert answer.status_code == 200, answer.text
    me = ldap_api.get("/api/v1/whoami", headers=bearer(answer.json()["token"]))
    assert me.json() == {"user": "bob", "admin": True}


def test_a_wrong_password_and_an_unknown_user_get_the_same_refusal(ldap_api: TestClient) -> None:
    wrong = ldap_api.post(SIGN_IN, json={"user": "alice", "password": PASSWORDS["bob"]})
    unknown = ldap_api.post(SIGN_IN, json={"user": "carol", "password": "whatever"})

    assert (wrong.status_code, unknown.status_code) == (401, 401), (wrong.text, unknown.text)
    assert wrong.json() == unknown.json()
    assert "wrong user name or password" in wrong.text
    refusals = [entry for entry in audit_of(ldap_api) if entry["action"] == "login.refused"]
    assert sorted(entry["actor"] for entry in refusals) == ["alice", "carol"]
    assert all(entry["target"] == "ldap" for entry in refusals)


@pytest.mark.parametrize("user", ["*", "alice)(uid=*", "alice,ou=people", "bob\\2a", "alice*", " alice"])
def test_a_user_name_that_is_not_a_plain_account_name_is_refused_before_ldap(
    ldap_api: TestClient, user: str
) -> None:
    answer = ldap_api.post(SIGN_IN, json={"user": user, "password": PASSWORDS["alice"]})

    assert answer.status_code == 422, answer.text
    assert answer.json()["detail"][0]["loc"][-1] == "user"


def test_the_domain_refuses_an_injection_and_an_empty_password_itself(
    settings: Settings, engine: Engine, slapd_server: SlapdServer
) -> None:
    """Whatever calls it, not only the route's validation: an empty password would be an anonymous
    bind, which LDAP lets through."""
    settings = ldap_settings(settings, slapd_server.url)
    guard = LoginGuard(10)
    with pytest.raises(InvalidRequest) as refused:
        ldap_login.ldap_login(engine, settings, guard, "*)(uid=*", "x", "127.0.0.1")
    assert refused.value.field == "user"
    with pytest.raises(Unauthenticated):
        ldap_login.ldap_login(engine, settings, guard, "alice", "", "127.0.0.1")


def test_failed_sign_ins_are_limited_even_for_the_right_password(ldap_api: TestClient) -> None:
    for _ in range(4):
        assert ldap_api.post(SIGN_IN, json={"user": "alice", "password": "nope"}).status_code == 401

    answer = ldap_api.post(SIGN_IN, json={"user": "alice", "password": PASSWORDS["alice"]})

    assert answer.status_code == 429, answer.text


def test_an_ldap_that_does_not_answer_is_503_and_none_configured_is_404(
    settings: Settings, fake: FakeBackend
) -> None:
    down = ldap_settings(settings, f"ldap://127.0.0.1:{free_port()}").model_copy(update={"ldap_timeout_s": 2})
    with TestClient(create_app(down, backends={"local": fake, "slurm": FakeBackend()})) as api:
        answer = api.post(SIGN_IN, json={"user": "alice", "password": "x"})
        assert answer.status_code == 503, answer.text
    with TestClient(create_app(settings, backends={"local": fake, "slurm": FakeBackend()})) as api:
        answer = api.post(SIGN_IN, json={"user": "alice", "password": "x"})
        assert answer.status_code == 404, answer.text
        assert "TORCHYARD_LDAP_URL" in answer.text


def search_settings(settings: Settings, url: str, bind_password: str = ROOT_PASSWORD) -> Settings:
    """The DN found by a search bound as the service, not made from a template (which is left wrong)."""
    return ldap_settings(settings, url).model_copy(
        update={
            "ldap_user_dn": "uid={user},ou=nowhere",
            "ldap_search_base": SUFFIX,
            "ldap_search_filter": "(&(objectClass=posixAccount)(uid={user}))",
            "ldap_bind_dn": ROOT_DN,
            "ldap_bind_password": SecretStr(bind_password),
        }
    )


def test_a_search_bound_as_the_service_finds_the_users_dn(
    settings: Settings, fake: FakeBackend, slapd_server: SlapdServer
) -> None:
    app = create_app(
        search_settings(settings, slapd_server.url), backends={"local": fake, "slurm": FakeBackend()}
    )
    with TestClient(app) as api:
        alice = api.post(SIGN_IN, json={"user": "alice", "password": PASSWORDS["alice"]})
        bob = api.post(SIGN_IN, json={"user": "bob", "password": PASSWORDS["bob"]})
        wrong = api.post(SIGN_IN, json={"user": "alice", "password": "nope"})
        unknown = api.post(SIGN_IN, json={"user": "carol", "password": "nope"})

        assert (alice.status_code, bob.status_code) == (200, 200), (alice.text, bob.text)
        assert api.get("/api/v1/whoami", headers=bearer(alice.json()["token"])).json()["admin"] is False
        assert api.get("/api/v1/whoami", headers=bearer(bob.json()["token"])).json()["admin"] is True
        assert (wrong.status_code, unknown.status_code) == (401, 401)
        assert wrong.json() == unknown.json()


def test_a_service_bind_ldap_refuses_is_503_not_the_users_fault(
    settings: Settings, fake: FakeBackend, slapd_server: SlapdServer
) -> None:
    refused = search_settings(settings, slapd_server.url, bind_password="not-the-admins")
    with TestClient(create_app(refused, backends={"local": fake, "slurm": FakeBackend()})) as api:
        answer = api.post(SIGN_IN, json={"user": "alice", "password": PASSWORDS["alice"]})

    assert answer.status_code == 503, answer.text
    assert "TORCHYARD_LDAP_BIND_DN" in answer.text
