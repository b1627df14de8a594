"""Repeat list polls answered from the page rendered under the same ledger clock value: the same bytes
and headers, never a page another caller, an older ledger, a revoked token or an invalid query should
not get."""

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


def page_hits(client: TestClient) -> int:
    return runtime_of(client).pages.hits


def same_answer(first: Response, second: Response) -> None:
    assert (second.status_code, second.content) == (first.status_code, first.content)
    for name in ("etag", "cache-control", "x-server-time", "vary", "content-type", "content-length"):
        assert second.headers.get(name) == first.headers.get(name), name


def test_a_repeat_poll_is_answered_from_the_rendered_page_with_the_same_answer(api: TestClient) -> None:
    submit(api, name="one")
    settled(api)
    unseen = f"{JOBS}?limit=7"  # a page not rendered yet under this clock value
    rendered = api.get(unseen)
    answered = page_hits(api)
    repeated = api.get(unseen)

    assert page_hits(api) == answered + 1
    same_answer(rendered, repeated)
    assert [job["name"] for job in repeated.json()["items"]] == ["one"]
    # If-None-Match with the page's tag: a 304 decided from the clock, without looking the page up.
    not_modified = api.get(unseen, headers={"If-None-Match": rendered.headers["etag"]})
    assert not_modified.status_code == 304 and not_modified.content == b""
    assert not_modified.headers["etag"] == rendered.headers["etag"] and page_hits(api) == answered + 1


def test_a_change_to_the_ledger_is_seen_by_the_next_poll(api: TestClient) -> None:
    submit(api, name="one")
    settled(api)
    answered = page_hits(api)
    before = api.get(QUERY)
    assert page_hits(api) == answered + 1

    submit(api, name="two")
    after = api.get(QUERY)

    assert [job["name"] for job in after.json()["items"]] == ["two", "one"]
    assert after.headers["etag"] != before.headers["etag"]
    assert api.get(QUERY, headers={"If-None-Match": before.headers["etag"]}).status_code == 200


def test_one_callers_page_is_never_served_to_another(api: TestClient, login: Login) -> None:
    submit(api, name="alices")
    settled(api)  # alice's page is now rendered under this clock value
    bob = login("bob")

    bobs = api.get(QUERY, headers=bob)
    admins = api.get(QUERY, headers=login("root", admin=True))

    assert bobs.status_code == 200 and bobs.json()["items"] == []
    assert bobs.headers["etag"] != api.get(QUERY).headers["etag"]
    assert [job["name"] for job in admins.json()["items"]] == ["alices"]
    # bob's revalidation with alice's tag gets bob's page, not a 304
    alices_tag = api.get(QUERY).headers["etag"]
    assert api.get(QUERY, headers={**bob, "If-None-Match": alices_tag}).status_code == 200


def test_an_invalid_query_or_token_never_gets_a_rendered_page(api: TestClient) -> None:
    settled(api)
    assert api.get(QUERY).status_code == 200  # the page is rendered and cached
    bad = f"{JOBS}?limit=0"
    for _ in range(3):
        response = api.get(bad)
        assert response.status_code == 422 and "limit" in response.text
    assert api.get(QUERY, headers={"Authorization": "Bearer ty_unknown"}).status_code == 401
    assert api.get(QUERY, headers={"Authorization": ""}).status_code == 401


def test_a_revoked_token_is_refused_once_the_token_cache_lets_it_go(settings: Settings) -> None:
    short = settings.model_copy(update={"token_cache_s": 0.3})
    with TestClient(create_app(short, backends={"local": FakeBackend("local")})) as client:
        engine = runtime_of(client).engine
        with session_scope(engine) as session:
            raw = auth.create_token(session, "carol")
        settled(client, bearer(raw))
        answered = page_hits(client)
        assert answered >= 1
        with session_scope(engine) as session:
            [row] = [row for row in auth.list_tokens(session) if row.username == "carol"]
            auth.revoke_token(session, row.id or 0)

        time.sleep(0.4)  # the documented window: token_cache_s
        response = client.get(QUERY, headers=bearer(raw))

    assert response.status_code == 401 and "revoked" in response.text
    assert page_hits(client) == answered
