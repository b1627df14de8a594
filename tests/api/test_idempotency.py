"""Idempotency-Key on POST /api/v1/jobs: a retried request returns the first job, never a second."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event
from sqlmodel import Session, func, select

from service.app import create_app
from service.config import Settings
from service.ledger.models.jobs import Job
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import JOBS, bearer, issue_token, runtime_of

BODY: dict[str, Any] = {"name": "idem", "entrypoint": "worker.tasks.seed:ddp_step"}


def jobs_in_ledger(api: TestClient) -> int:
    with Session(runtime_of(api).engine) as session:
        return int(session.exec(select(func.count()).select_from(Job)).one())


def test_a_retry_with_the_same_key_returns_the_first_job(api: TestClient) -> None:
    first = api.post(JOBS, json=BODY, headers={"Idempotency-Key": "run-42"})
    retry = api.post(JOBS, json=BODY, headers={"Idempotency-Key": "run-42"})
    other = api.post(JOBS, json=BODY, headers={"Idempotency-Key": "run-43"})

    assert first.status_code == 201 and retry.status_code == 200 and other.status_code == 201
    assert retry.json()["id"] == first.json()["id"] != other.json()["id"]
    assert jobs_in_ledger(api) == 2


def test_concurrent_retries_make_one_job(api: TestClient) -> None:
    def post(_: int) -> Any:
        return api.post(JOBS, json=BODY, headers={"Idempotency-Key": "burst"})

    with ThreadPoolExecutor(max_workers=8) as pool:
        responses = list(pool.map(post, range(16)))

    assert {r.json()["id"] for r in responses} == {responses[0].json()["id"]}
    assert sorted(r.status_code for r in responses) == [200] * 15 + [201]
    assert jobs_in_ledger(api) == 1


def test_the_same_key_with_a_different_request_is_a_conflict(api: TestClient) -> None:
    first = api.post(JOBS, json=BODY, headers={"Idempotency-Key": "k"})
    changed = api.post(JOBS, json={**BODY, "name": "other"}, headers={"Idempotency-Key": "k"})

    assert changed.status_code == 409
    [problem] = changed.json()["detail"]
    assert problem["loc"] == ["Idempotency-Key"]
    assert f"already used for a different request (job {first.json()['id']})" in problem["msg"]
    assert jobs_in_ledger(api) == 1


def test_keys_belong_to_their_user(api: TestClient, login: Login) -> None:
    alices = api.post(JOBS, json=BODY, headers={"Idempotency-Key": "shared"})
    bobs = api.post(JOBS, json=BODY, headers={**login("bob"), "Idempotency-Key": "shared"})

    assert alices.status_code == bobs.status_code == 201
    assert bobs.json()["id"] != alices.json()["id"] and bobs.json()["owner"] == "bob"


def test_a_malformed_key_is_refused(api: TestClient) -> None:
    for key in ("", "x" * 201, "with space"):
        response = api.post(JOBS, json=BODY, headers={"Idempotency-Key": key})
        assert response.status_code == 422, key
        assert response.json()["detail"][0]["loc"] == ["header", "idempotency-key"]
    assert jobs_in_ledger(api) == 0


def test_a_retry_is_answered_with_the_job_as_its_columns_say(api: TestClient) -> None:
    """The retry's job is read from its columns (service.api.reader): its JSON columns and times as
    the first answer rendered them (the job itself moves on meanwhile: its state is not compared)."""
    retries = {"max": 3, "backoff_s": 1, "on": ["preemption"]}
    body = {**BODY, "kwargs": {"n": [1, {"a": None}]}, "retries": retries}
    first = api.post(JOBS, json=body, headers={"Idempotency-Key": "columns"}).json()
    retry = api.post(JOBS, json=body, headers={"Idempotency-Key": "columns"}).json()

    for field in ("id", "name", "owner", "backend", "spec", "retries", "folder", "created_at", "attempt"):
        assert retry[field] == first[field], field
    assert retry["spec"]["kwargs"] == {"n": [1, {"a": None}]} and retry["retries"]["max"] == 3
    assert retry["updated_at"] >= first["updated_at"]


@pytest.fixture
def steady_api(settings: Settings) -> Iterator[TestClient]:
    """`api` with a token checked once for the whole test: no lookup of it takes a connection."""
    steady = settings.model_copy(update={"token_cache_s": 3600.0})
    app = create_app(steady, backends={"local": FakeBackend("local")})
    with TestClient(app) as client:
        client.headers.update(bearer(issue_token(app.state.runtime.engine, "alice")))
        yield client


def test_a_retry_takes_no_pooled_connection(steady_api: TestClient) -> None:
    """A keyed POST looks its key up from the event loop, on the reader's own connections: in a worker
    thread on a pooled one it cost four round trips to PostgreSQL (ping, BEGIN, query, ROLLBACK)."""
    first = steady_api.post(JOBS, json=BODY, headers={"Idempotency-Key": "again"})
    taken: list[str] = []

    def note(*_: object) -> None:
        if not threading.current_thread().name.startswith("torchyard-"):  # the service's own loops
            taken.append(threading.current_thread().name)

    engine = runtime_of(steady_api).engine
    event.listen(engine, "checkout", note)
    try:
        retries = [steady_api.post(JOBS, json=BODY, headers={"Idempotency-Key": "again"}) for _ in range(10)]
    finally:
        event.remove(engine, "checkout", note)

    assert {(r.status_code, r.json()["id"]) for r in retries} == {(200, first.json()["id"])}
    assert taken == []
