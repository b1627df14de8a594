"""Retry policies through the API, the loops running against fake backends: an attempt that ends for a
covered reason is followed by another after its backoff (same id, attempt + 1, a fresh submission);
cancel during the backoff ends the job; a restart keeps the retry, and makes exactly one."""

from __future__ import annotations

import json
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import JOBS, authorize, get_job, submit, wait_for, wait_state

FAST = {"max": 2, "backoff_s": 0.3, "backoff_factor": 2, "on": ["node_failure", "failure"]}


def attempts(api: TestClient, job_id: int) -> list[dict[str, Any]]:
    response = api.get(f"{JOBS}/{job_id}/attempts")
    assert response.status_code == 200, response.text
    found: list[dict[str, Any]] = response.json()
    return found


def is_running_attempt(api: TestClient, job_id: int, attempt: int) -> bool:
    job = get_job(api, job_id)
    return bool(job["state"] == "running" and job["attempt"] == attempt)


def event_times(api: TestClient, job_id: int, state: str) -> list[datetime]:
    events = api.get(f"{JOBS}/{job_id}/events").json()
    return [datetime.fromisoformat(e["time"]) for e in events if e["to_state"] == state]


def test_a_node_failure_is_retried_and_the_second_attempt_succeeds(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = submit(api, retries=FAST)["id"]
    wait_state(api, job_id, "running")
    fake.set_status(job_id, JobState.running, nodes="n[1-2]")
    wait_for(lambda: get_job(api, job_id)["nodes"] == "n[1-2]", what="the nodes recorded")
    fake.set_status(job_id, JobState.failed, "node failure", exit_code=1, kind="node_failure")

    retrying = wait_state(api, job_id, "retrying")
    assert retrying["attempt"] == 2 and retrying["retry_at"] is not None
    assert "attempt 1 ended (node_failure): node failure (nodes n[1-2])" in retrying["reason"]
    wait_state(api, job_id, "running")
    assert len([call for call in fake.submit_calls if job_id in call]) == 2  # a fresh submission
    assert fake.specs[job_id].attempt == 2
    fake.finish(job_id, {"loss": 0.1})
    done = wait_state(api, job_id, "succeeded")

    assert done["attempt"] == 2 and done["result"] == {"loss": 0.1}
    first, second = attempts(api, job_id)
    assert (first["attempt"], first["state"], first["kind"], first["nodes"]) == (
        1,
        "failed",
        "node_failure",
        "n[1-2]",
    )
    assert first["external_id"] == fake.external_id(job_id) and first["ended_at"] is not None
    assert (second["attempt"], second["state"], second["kind"]) == (2, "succeeded", None)
    [retried] = event_times(api, job_id, "retrying")
    resubmitted = event_times(api, job_id, "submitted")[1]
    assert (resubmitted - retried).total_seconds() >= 0.3  # the backoff was waited out


def test_a_rank_error_the_policy_does_not_cover_ends_the_job(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api, retries={"max": 2, "backoff_s": 0})["id"]  # the default kinds: not "failure"
    wait_state(api, job_id, "running")
    files = fake.specs[job_id].files
    files.error(0).write_text("Traceback (most recent call last):\nValueError: bad lr")
    fake.set_status(job_id, JobState.failed, None, 1)  # the job's supervisor ends the attempt

    failed = wait_state(api, job_id, "failed")

    assert failed["attempt"] == 1 and "rank 0 raised" in failed["reason"]
    assert [(a["attempt"], a["kind"]) for a in attempts(api, job_id)] == [(1, "failure")]


def test_exhausted_retries_end_the_job_with_every_attempt_listed(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api, retries={**FAST, "max": 1})["id"]
    for attempt in (1, 2):
        wait_for(partial(is_running_attempt, api, job_id, attempt), what=f"attempt {attempt} running")
        # The error files of attempt 1 were moved aside: attempt 2 is not ended by them at once.
        assert not list(fake.specs[job_id].files.folder.glob("error-rank*.txt"))
        fake.specs[job_id].files.error(0).write_text("Traceback (most recent call last):\nValueError: no")
        fake.set_status(job_id, JobState.failed, None, 1)  # the job's supervisor ends the attempt

    failed = wait_state(api, job_id, "failed")

    assert failed["attempt"] == 2
    assert [(a["attempt"], a["state"], a["kind"]) for a in attempts(api, job_id)] == [
        (1, "failed", "failure"),
        (2, "failed", "failure"),
    ]
    archived = Path(failed["folder"]) / "attempts" / "1"
    assert (archived / "error-rank0.txt").exists() and (archived / "submitit").is_dir()


def test_a_job_without_retries_ends_on_its_first_failure(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api, retries={"max": 0})["id"]
    wait_state(api, job_id, "running")
    fake.set_status(job_id, JobState.failed, "node failure", kind="node_failure")

    assert wait_state(api, job_id, "failed")["attempt"] == 1


def test_cancel_during_the_backoff_ends_the_job_and_nothing_goes_out_again(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = submit(api, retries={**FAST, "backoff_s": 30})["id"]
    wait_state(api, job_id, "running")
    fake.set_status(job_id, JobState.failed, "node failure", kind="node_failure")
    wait_state(api, job_id, "retrying")

    cancelled = api.post(f"{JOBS}/{job_id}/cancel")

    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert len([call for call in fake.submit_calls if job_id in call]) == 1
    assert [(a["attempt"], a["state"]) for a in attempts(api, job_id)] == [(1, "failed"), (2, "cancelled")]


def test_a_retry_waiting_its_backoff_survives_a_restart_and_goes_out_once(settings: Settings) -> None:
    first = FakeBackend("local")
    with TestClient(create_app(settings, backends={"local": first})) as client:
        api = authorize(client)
        job_id = submit(api, retries={**FAST, "backoff_s": 2})["id"]
        wait_state(api, job_id, "running")
        first.set_status(job_id, JobState.failed, "node failure", kind="node_failure")
        wait_state(api, job_id, "retrying")
    # The service stopped during the backoff; the next one finds the retry in the ledger.
    second = FakeBackend("local")
    with TestClient(create_app(settings, backends={"local": second})) as client:
        api = authorize(client)
        running = wait_state(api, job_id, "running", timeout=15)
        second.finish(job_id, {"ok": True})
        wait_state(api, job_id, "succeeded")
        history = [a["state"] for a in attempts(api, job_id)]

    assert running["attempt"] == 2
    assert [call for call in first.submit_calls if job_id in call] == [[job_id]]
    assert [call for call in second.submit_calls if job_id in call] == [[job_id]]
    assert history == ["failed", "succeeded"]


def test_each_attempt_records_where_its_ranks_ran(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api, retries=FAST, resources={"nodes": 1, "tasks_per_node": 2})["id"]
    for attempt, hosts in ((1, ["n1", "n1"]), (2, ["n2", "n2"])):
        wait_for(partial(is_running_attempt, api, job_id, attempt), what=f"attempt {attempt} running")
        files = fake.specs[job_id].files
        for rank, host in enumerate(hosts):
            record = {"attempt": attempt, "rank": rank, "host": host, "local_rank": rank, "gpu": str(rank)}
            files.placement(rank).parent.mkdir(exist_ok=True)
            files.placement(rank).write_text(json.dumps(record))
        placed = wait_for(lambda: get_job(api, job_id)["placement"], what="the placement read")
        assert [(p["rank"], p["host"], p["gpu"]) for p in placed] == [(0, hosts[0], "0"), (1, hosts[1], "1")]
        if attempt == 1:
            fake.set_status(job_id, JobState.failed, "node failure", kind="node_failure")
    fake.finish(job_id, {"ok": True})
    wait_state(api, job_id, "succeeded")

    first, second = attempts(api, job_id)
    assert {p["host"] for p in first["placement"]} == {"n1"}
    assert {p["host"] for p in second["placement"]} == {"n2"}
