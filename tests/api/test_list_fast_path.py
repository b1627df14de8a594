"""Repeat list polls answered before routing: the same bytes and headers the route gives, never a page
another caller, an older ledger, a revoked token or an invalid query should not get."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient
from httpx import Response

from service.app import create_app
from service.config import Settings
from service.domain import auth
from service.ledger.db import session_scope
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import bearer, runtime_of, submit, wait_for

JOBS = "/api/v1/jobs"
QUERY = f"{JOBS}?limit=5"


def settled(client: TestClient, headers: dict[str, str] | None = None) -> None:
    """Wait until the loops have moved the submitted jobs on: the ledger clock stops changing."""

    def still() -> bool:
        first = client.get(QUERY, headers=headers).headers["etag"]
        time.sleep(0.2)
        return bool(client.get(QUERY, headers=headers).headers["etag"] == first)

    wait_for(still, what="the ledger to settle")


def fast_answers(client: TestClient) -> int:
    return runtime_of(client).list_fast_answers


def same_answer(first: Response, second: Response) -> None:
    assert (second.status_code, second.content) == (first.status_code, first.content)
    for name in ("etag", "cache-control", "x-server-time", "vary", "content-type", "content-length"):
        assert second.headers.get(name) == first.headers.get(name), name


def test_a_repeat_poll_is_answered_before_routing_with_the_routes_own_answer(api: TestClient) -> None:
    submit(api, name="one")
    settled(api)
    answered = fast_answers(api)
    unseen = f"{JOBS}?limit=05"  # the same page, but a raw query string not answered yet
    routed = api.get(unseen)
    assert fast_answers(api) == answered
    repeated = api.get(unseen)

    assert fast_answers(api) == answered + 1
    same_answer(routed, repeated)
    assert [job["name"] for job in repeated.json()["items"]] == ["one"]
    # If-None-Match with the page's tag: a 304, as the route gives it.
    not_modified = api.get(unseen, headers={"If-None-Match": routed.headers["etag"]})
    assert not_modified.status_code == 304 and not_modified.content == b""
    assert not_modified.headers["etag"] == routed.headers["etag"] and fast_answers(api) == answered + 2


def test_a_change_to_the_ledger_is_seen_by_the_next_poll(api: TestClient) -> None:
    submit(api, name="one")
    settled(api)
    answered = fast_answers(api)
    before = api.get(QUERY)
    assert fast_answers(api) == answered + 1

    submit(api, name="two")
    after = api.get(QUERY)

    assert [job["name"] for job in after.json()["items"]] == ["two", "one"]
    assert after.headers["etag"] != before.headers["etag"]
    assert api.get(QUERY, headers={"If-None-Match": before.headers["etag"]}).status_code == 200


def test_one_callers_page_is_never_served_to_another(api: TestClient, login: Login) -> None:
    submit(api, name="alices")
    settled(api)  # alice's page is now answered before routing
    bob = login("bob")

    bobs = api.get(QUERY, headers=bob)
    admins = api.get(QUERY, headers=login("root", admin=True))

    assert bobs.status_code == 200 and bobs.json()["items"] == []
    assert bobs.headers["etag"] != api.get(QUERY).headers["etag"]
    assert [job["name"] for job in admins.json()["items"]] == ["alices"]
    # bob's revalidation with alice's tag gets bob's page, not a 304
    alices_tag = api.get(QUERY).headers["etag"]
    assert api.get(QUERY, headers={**bob, "If-None-Match": alices_tag}).status_code == 200


def test_an_invalid_query_is_never_answered_before_routing(api: TestClient) -> None:
    bad = f"{JOBS}?limit=0"
    for _ in range(3):
        response = api.get(bad)
        assert response.status_code == 422 and "limit" in response.text
    assert api.get(f"{JOBS}?limit=5", headers={"Authorization": "Bearer ty_unknown"}).status_code == 401
    assert api.get(f"{JOBS}?limit=5", headers={"Authorization": ""}).status_code == 401
    assert fast_answers(api) == 0


def test_a_revoked_token_is_refused_once_the_token_cache_lets_it_go(settings: Settings) -> None:
    short = settings.model_copy(update={"token_cache_s": 0.3})
    with TestClient(create_app(short, backends={"local": FakeBackend("local")})) as client:
        engine = runtime_of(client).engine
        with session_scope(engine) as session:
            raw = auth.create_token(session, "carol")
        settled(client, bearer(raw))
        answered = fast_answers(client)
        assert answered >= 1
        with session_scope(engine) as session:
            [row] = [row for row in auth.list_tokens(session) if row.username == "carol"]
            auth.revoke_token(session, row.id or 0)

        time.sleep(0.4)  # the documented window: token_cache_s
        response = client.get(QUERY, headers=bearer(raw))

    assert response.status_code == 401 and "revoked" in response.text
    assert fast_answers(client) == answered


def test_dev_mode_is_always_routed(settings: Settings) -> None:
    dev = settings.model_copy(update={"dev_mode": True, "host": "127.0.0.1"})
    app = create_app(dev, backends={"local": FakeBackend("local")})
    with TestClient(app, client=("127.0.0.1", 50000)) as client:  # dev mode answers loopback only
        first, second = client.get(QUERY), client.get(QUERY)
        assert first.status_code == second.status_code == 200
        assert fast_answers(client) == 0
