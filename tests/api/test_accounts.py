"""Through the API: a job records the Unix account it runs as, and a user without one is refused."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service import accounts
from service.app import create_app
from service.config import Settings
from tests.fakes import FakeBackend
from tests.support import bearer, issue_token, runtime_of

JOB = {"name": "a", "entrypoint": "worker.tasks.seed:ddp_step"}


@pytest.fixture
def owner_api(settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    """A service whose jobs run as their owners, deciding as a root service does (the fake backend
    starts nothing, so no account is really switched)."""
    monkeypatch.setattr(accounts, "can_switch_accounts", lambda: True)
    # nobody (65534, above UID_MAX) stands for a person's account: the one every host has
    monkeypatch.setattr(
        accounts, "person_uids", lambda: range(1000, accounts.Account.named("nobody").uid + 1)
    )
    tuned = settings.model_copy(update={"job_accounts": "owner"})
    with TestClient(create_app(tuned, backends={"local": FakeBackend("local")})) as client:
        yield client


def token(client: TestClient, user: str, unix_user: str | None = None, admin: bool = False) -> dict[str, str]:
    return bearer(issue_token(runtime_of(client).engine, user, admin=admin, unix_user=unix_user))


def jobs(client: TestClient) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = client.get(
        "/api/v1/jobs", headers=token(client, "root", admin=True)
    ).json()["items"]
    return items


def test_a_job_shows_the_account_it_runs_as(owner_api: TestClient) -> None:
    named = owner_api.post("/api/v1/jobs", json=JOB, headers=token(owner_api, "nobody"))
    mapped = owner_api.post("/api/v1/jobs", json=JOB, headers=token(owner_api, "dave", unix_user="nobody"))
    assert named.status_code == mapped.status_code == 201, named.text + mapped.text
    assert named.json()["run_as"] == mapped.json()["run_as"] == "nobody"
    again = owner_api.get(f"/api/v1/jobs/{mapped.json()['id']}", headers=token(owner_api, "dave"))
    assert again.json()["run_as"] == "nobody" and again.json()["owner"] == "dave"


def test_a_user_without_an_account_is_refused_and_nothing_is_stored(owner_api: TestClient) -> None:
    response = owner_api.post("/api/v1/jobs", json=JOB, headers=token(owner_api, "carol-has-no-account"))
    assert response.status_code == 403, response.text
    assert "no Unix account" in response.text and "--unix-user" in response.text
    assert jobs(owner_api) == []


def test_a_token_cannot_map_to_something_that_is_no_account_name(settings: Settings) -> None:
    with TestClient(create_app(settings, backends={"local": FakeBackend("local")})) as client:
        from service.domain import auth
        from service.errors import InvalidRequest
        from service.ledger.db import session_scope

        with session_scope(runtime_of(client).engine) as session, pytest.raises(InvalidRequest) as refused:
            auth.create_token(session, "eve", unix_user="root;rm -rf /")
    assert refused.value.field == "unix_user"


def test_a_user_named_like_root_or_mapped_to_a_system_account_is_refused(owner_api: TestClient) -> None:
    named = owner_api.post("/api/v1/jobs", json=JOB, headers=token(owner_api, "root"))
    mapped = owner_api.post("/api/v1/jobs", json=JOB, headers=token(owner_api, "eve", unix_user="daemon"))
    assert named.status_code == mapped.status_code == 403, named.text + mapped.text
    assert "user 'root' would run jobs as the Unix account of that name, which is root" in named.text
    assert "maps you to the Unix account 'daemon', which is a system account" in mapped.text
    assert jobs(owner_api) == []
