"""Idempotency-Key on POST /api/v1/jobs: a retried request returns the first job, never a second."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from service.ledger.models import Job
from tests.conftest import Login
from tests.support import JOBS, runtime_of

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
