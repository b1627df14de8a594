"""List pages joined from each job's JSON rendered once per version (service.api.fragments): a repeat
poll renders nothing and gives the same bytes and headers, a change renders only the changed job, and
no page holds what another caller, an older ledger, a revoked token or an invalid query should not get."""

from __future__ import annotations

import time
from datetime import datetime

from fastapi.testclient import TestClient
from httpx import Response
from sqlmodel import Session, col, select

from service.app import create_app
from service.config import Settings
from service.domain import auth
from service.ledger.db import session_scope, write_scope
from service.ledger.models.jobs import Job, JobPage, JobPublic
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
    """Jobs answered with a rendering already kept."""
    return runtime_of(client).fragments.hits


def renderings(client: TestClient) -> int:
    """Jobs read whole and rendered."""
    return runtime_of(client).fragments.misses


def same_answer(first: Response, second: Response) -> None:
    assert (second.status_code, second.content) == (first.status_code, first.content)
    for name in ("etag", "cache-control", "x-server-time", "vary", "content-type", "content-length"):
        assert second.headers.get(name) == first.headers.get(name), name


def test_a_repeat_poll_renders_nothing_and_gives_the_same_answer(api: TestClient) -> None:
    submit(api, name="one")
    submit(api, name="two")
    settled(api)
    unseen = f"{JOBS}?limit=7"  # a page not asked for yet: its jobs were rendered by the other polls
    rendered = api.get(unseen)
    answered, rendered_before = page_hits(api), renderings(api)
    repeated = api.get(unseen)

    assert renderings(api) == rendered_before and page_hits(api) <= answered + 2
    same_answer(rendered, repeated)
    assert [job["name"] for job in repeated.json()["items"]] == ["two", "one"]
    # If-None-Match with the page's tag: a 304 decided from the clock, no job looked at.
    not_modified = api.get(unseen, headers={"If-None-Match": rendered.headers["etag"]})
    assert not_modified.status_code == 304 and not_modified.content == b""
    assert not_modified.headers["etag"] == rendered.headers["etag"] and renderings(api) == rendered_before


def test_a_joined_page_is_byte_for_byte_what_the_page_model_writes(api: TestClient) -> None:
    for n in range(3):
        submit(api, name=f"job-{n}")
    settled(api)
    api.get(f"{JOBS}?limit=2")  # every job rendered and kept
    page = api.get(f"{JOBS}?limit=2")
    assert page_hits(api) >= 2

    with Session(runtime_of(api).engine) as session:
        rows = session.exec(select(Job).order_by(col(Job.id).desc()).limit(2)).all()
        items = [JobPublic.model_validate(row, from_attributes=True) for row in rows]
    written = JobPage(
        items=items,
        next_cursor=page.json()["next_cursor"],
        server_time=datetime.fromisoformat(page.headers["x-server-time"]),
    )
    assert page.content == written.model_dump_json().encode()
    assert page.json()["next_cursor"] is not None


def test_a_change_renders_only_the_changed_job(api: TestClient) -> None:
    ids = [submit(api, name=f"job-{n}")["id"] for n in range(4)]
    settled(api)
    api.get(QUERY)
    before = renderings(api)
    with write_scope(runtime_of(api).engine) as session:
        job = session.get(Job, ids[1])
        assert job is not None
        job.progress = {"step": 7, "total": 10}
        session.add(job)

    page = api.get(QUERY).json()["items"]

    assert renderings(api) == before + 1
    assert [item["progress"] for item in page if item["id"] == ids[1]] == [{"step": 7, "total": 10}]


def test_a_change_to_the_ledger_is_seen_by_the_next_poll(api: TestClient) -> None:
    submit(api, name="one")
    settled(api)
    before = api.get(QUERY)  # the page kept while the clock stands still (LastPages)
    assert api.get(QUERY).content == before.content

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
        answered = page_hits(client), renderings(client)
        with session_scope(engine) as session:
            [row] = [row for row in auth.list_tokens(session) if row.username == "carol"]
            auth.revoke_token(session, row.id or 0)

        time.sleep(0.4)  # the documented window: token_cache_s
        response = client.get(QUERY, headers=bearer(raw))

    assert response.status_code == 401 and "revoked" in response.text
    assert (page_hits(client), renderings(client)) == answered  # refused before any job was looked at
