"""Per-user limits: job size (403), unfinished jobs and submissions per minute (429 + Retry-After),
with per-user overrides from the `userquota` table."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.ledger.db import session_scope
from service.ledger.models.access import UserQuota
from tests.fakes import FakeBackend
from tests.serving import serve
from tests.support import JOBS, authorize, get_job, login_headers, runtime_of, wait_for

BODY: dict[str, Any] = {"name": "q", "entrypoint": "worker.tasks.seed:ddp_step"}


def message(response: Any) -> str:
    return " ".join(str(item["msg"]) for item in response.json()["detail"])


@pytest.fixture
def tight(settings: Settings, fake: FakeBackend) -> Any:
    limits = settings.model_copy(
        update={
            "max_active_jobs_per_user": 3,
            "max_submissions_per_minute": 5,
            "max_tasks_per_job": 6,
            "max_gpus_per_job": 2,
        }
    )
    with TestClient(create_app(limits, backends={"local": fake, "slurm": FakeBackend("slurm")})) as client:
        yield authorize(client)


def test_a_cancel_frees_its_room_at_once(tight: TestClient) -> None:
    """A user at the limit cancels one job and submits another straight away: no 429 while this
    replica's count of their jobs is fresh (it is kept for a couple of seconds)."""
    ids = [tight.post(JOBS, json=BODY).json()["id"] for _ in range(3)]
    assert tight.post(JOBS, json=BODY).status_code == 429
    # Out of the dispatcher's hands: a cancel that meets a job mid-dispatch only flags it, and the
    # dispatcher ends it a moment later.
    wait_for(lambda: get_job(tight, ids[0])["external_id"], what="job submitted")

    tight.post(f"{JOBS}/{ids[0]}/cancel")
    after_cancel = tight.post(JOBS, json=BODY)

    assert after_cancel.status_code == 201, after_cancel.text
    assert tight.post(JOBS, json=BODY).status_code == 429  # the room was one job


def test_a_job_bigger_than_the_users_limit_is_refused_with_403(tight: TestClient) -> None:
    too_many_tasks = tight.post(
        JOBS, json={**BODY, "backend": "slurm", "resources": {"nodes": 2, "tasks_per_node": 4}}
    )
    too_many_gpus = tight.post(
        JOBS, json={**BODY, "backend": "slurm", "resources": {"nodes": 2, "gpus_per_node": 2}}
    )

    assert too_many_tasks.status_code == 403
    assert "8 tasks (nodes x tasks_per_node); your limit is 6" in message(too_many_tasks)
    assert too_many_gpus.status_code == 403
    assert "4 GPUs (nodes x gpus_per_node); your limit is 2" in message(too_many_gpus)


def test_unfinished_jobs_are_capped_per_user_and_freed_when_they_finish(tight: TestClient) -> None:
    ids = [tight.post(JOBS, json=BODY).json()["id"] for _ in range(3)]
    over = tight.post(JOBS, json=BODY)
    bob = tight.post(JOBS, json=BODY, headers=_login(tight, "bob"))

    assert over.status_code == 429
    assert "3 unfinished jobs, your limit is 3" in message(over)
    assert int(over.headers["Retry-After"]) >= 1
    assert bob.status_code == 201  # the limit is alice's, not everyone's

    tight.post(f"{JOBS}/{ids[0]}/cancel")
    runtime_of(tight).quotas.refresh("alice")  # what the next POST after the refresh period does
    assert tight.post(JOBS, json=BODY).status_code == 201


def test_submissions_per_minute_are_capped(settings: Settings) -> None:
    limits = settings.model_copy(update={"max_submissions_per_minute": 4, "max_active_jobs_per_user": 100})
    with TestClient(create_app(limits, backends={"local": FakeBackend("local")})) as client:
        statuses = [authorize(client).post(JOBS, json=BODY).status_code for _ in range(6)]
        last = client.post(JOBS, json=BODY)

    assert statuses == [201, 201, 201, 201, 429, 429]
    assert "4 submissions per minute" in message(last)
    assert 1 <= int(last.headers["Retry-After"]) <= 60


def test_a_refused_request_uses_its_slot_of_the_minute_but_holds_no_room(settings: Settings) -> None:
    """The backend's validation (`sbatch --test-only` on SLURM) is asked for every submission that
    reaches it, so one it refuses has used its slot of the minute: a refusal gave the slot back, and a
    user changing the job's shape each time had the scheduler asked without end (issue 35). It holds
    no room among the user's unfinished jobs, though."""
    limits = settings.model_copy(update={"max_submissions_per_minute": 3, "max_active_jobs_per_user": 1})
    backend = FakeBackend("local")
    backend.refuse_validation = "no such partition"
    with TestClient(create_app(limits, backends={"local": backend})) as client:
        authorize(client)
        refused = [
            client.post(JOBS, json={**BODY, "resources": {"tasks_per_node": n}}).status_code for n in (1, 2)
        ]
        backend.refuse_validation = None
        accepted = client.post(JOBS, json=BODY)  # the refused ones took no room: one job fits
        over = [client.post(JOBS, json={**BODY, "resources": {"tasks_per_node": n}}) for n in (3, 4)]

    assert refused == [422, 422]
    assert accepted.status_code == 201, accepted.text
    assert [response.status_code for response in over] == [429, 429]
    assert all("3 submissions per minute" in message(response) for response in over)
    assert backend.validate_calls == 3  # the refused shapes past the limit were never validated


def test_a_users_own_limits_override_the_defaults(tight: TestClient) -> None:
    with session_scope(runtime_of(tight).engine) as session:
        session.add(UserQuota(username="alice", max_active_jobs=1, max_tasks=16))
    runtime_of(tight).quotas.refresh("alice")

    big = tight.post(JOBS, json={**BODY, "backend": "slurm", "resources": {"nodes": 2, "tasks_per_node": 4}})
    second = tight.post(JOBS, json=BODY)

    assert big.status_code == 201, big.text  # 8 tasks: over the default 6, inside alice's 16
    assert second.status_code == 429 and "your limit is 1" in message(second)


def _login(api: TestClient, user: str) -> dict[str, str]:
    return login_headers(api.app, user)


def test_an_idempotent_retry_at_the_limit_gets_its_job_not_429(tight: TestClient) -> None:
    keyed = [tight.post(JOBS, json=BODY, headers={"Idempotency-Key": f"k{i}"}) for i in range(3)]
    assert [response.status_code for response in keyed] == [201, 201, 201]  # now at the limit of 3

    retry = tight.post(JOBS, json=BODY, headers={"Idempotency-Key": "k1"})
    fresh = tight.post(JOBS, json=BODY, headers={"Idempotency-Key": "k9"})
    changed = tight.post(JOBS, json={**BODY, "name": "other"}, headers={"Idempotency-Key": "k2"})

    assert retry.status_code == 200 and retry.json()["id"] == keyed[1].json()["id"]
    assert fresh.status_code == 429  # a new request is still counted
    assert changed.status_code == 409  # the same key for a different request is still refused
    # the retries counted nothing: after one job ends, exactly one new job fits again
    tight.post(f"{JOBS}/{keyed[0].json()['id']}/cancel")
    runtime_of(tight).quotas.refresh("alice")
    assert tight.post(JOBS, json=BODY).status_code == 201
    assert tight.post(JOBS, json=BODY).status_code == 429


def test_concurrent_posts_at_the_limit_admit_exactly_the_limit(settings: Settings) -> None:
    """15 POSTs at once with room for 5. Each refresh of the count used to drop the jobs admitted but
    not yet committed, and all 15 got 201 (issue 15)."""
    limits = settings.model_copy(update={"max_active_jobs_per_user": 5})
    with serve(create_app(limits, backends={"local": FakeBackend("local")})) as server:
        headers = login_headers(server.app, "alice")
        barrier = threading.Barrier(15)

        def post(_: int) -> int:
            barrier.wait()
            return httpx.post(f"{server.url}{JOBS}", json=BODY, headers=headers, timeout=30).status_code

        with ThreadPoolExecutor(15) as pool:
            statuses = sorted(pool.map(post, range(15)))
        stored = httpx.get(f"{server.url}{JOBS}", headers=headers, timeout=30).json()["items"]

    assert statuses == [201] * 5 + [429] * 10
    assert len(stored) == 5


def test_an_interpreter_is_probed_only_within_the_users_rate(settings: Settings, tmp_path: Path) -> None:
    """An interpreter that does not run is refused, and no answer is kept, so it is run again at each
    submission that names it: those runs count against the submissions of the minute, which came
    only after it (issue 35)."""
    runs = tmp_path / "runs"
    python = tmp_path / "envs" / "bare" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho run >> {runs}\necho broken >&2\nexit 1\n")
    python.chmod(0o755)
    limits = settings.model_copy(
        update={"max_submissions_per_minute": 3, "allowed_pythons": [str(tmp_path / "envs")]}
    )
    with TestClient(create_app(limits, backends={"local": FakeBackend("local")})) as client:
        authorize(client)
        answers = [client.post(JOBS, json={**BODY, "python": str(python)}) for _ in range(5)]

    assert [answer.status_code for answer in answers] == [422, 422, 422, 429, 429]
    assert "does not run Python code: broken" in message(answers[0])
    assert "3 submissions per minute" in message(answers[-1])
    assert runs.read_text().count("run") == 3


def test_a_missing_code_snapshot_is_looked_for_only_within_the_users_rate(settings: Settings) -> None:
    limits = settings.model_copy(update={"max_submissions_per_minute": 2})
    job = {**BODY, "entrypoint": "train:main", "code": "sha256:" + "0" * 64}
    with TestClient(create_app(limits, backends={"local": FakeBackend("local")})) as client:
        authorize(client, admin=True)  # admins may run uploaded code
        answers = [client.post(JOBS, json=job).status_code for _ in range(4)]

    assert answers == [404, 404, 429, 429]


def test_a_retry_with_its_idempotency_key_is_answered_at_the_rate_limit(settings: Settings) -> None:
    limits = settings.model_copy(update={"max_submissions_per_minute": 2})
    with TestClient(create_app(limits, backends={"local": FakeBackend("local")})) as client:
        authorize(client)
        first = client.post(JOBS, json=BODY, headers={"Idempotency-Key": "a"})
        client.post(JOBS, json=BODY)
        over = client.post(JOBS, json=BODY, headers={"Idempotency-Key": "b"})
        retry = client.post(JOBS, json=BODY, headers={"Idempotency-Key": "a"})

    assert over.status_code == 429
    assert retry.status_code == 200 and retry.json()["id"] == first.json()["id"]
