"""Jobs that run after other jobs, through the API with the loops running against fake backends:
a dependent waits (saying for what), goes out once its dependencies ended as it asked, is cancelled
naming the one that cannot be met (and so on down the chain), waits out a dependency's retries, and
gets what they left (ctx.upstream) in its RunSpec."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.domain import dependencies
from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import JOBS, get_job, login_headers, submit, wait_state

FAST_RETRY = {"max": 1, "backoff_s": 0.2, "on": ["node_failure"]}


def test_a_dependent_waits_then_goes_out_with_what_its_dependency_left(
    api: TestClient, fake: FakeBackend
) -> None:
    first = submit(api, name="prepare")["id"]
    second = submit(api, name="train", after=[first])
    assert second["state"] == "waiting"
    assert second["reason"] == f"waiting for job {first} to succeed"
    wait_state(api, first, "running")
    assert get_job(api, second["id"])["state"] == "waiting"  # its dependency runs: it waits on
    assert second["id"] not in fake.specs

    fake.finish(first, {"rows": 8})
    wait_state(api, first, "succeeded")
    wait_state(api, second["id"], "running")
    spec = fake.specs[second["id"]]
    [upstream] = spec.upstream
    assert (upstream.job_id, upstream.name, upstream.state, upstream.result) == (
        first,
        "prepare",
        "succeeded",
        {"rows": 8},
    )
    assert spec.run_id.startswith(f"torchyard-{second['id']}-")
    events = [(e["from_state"], e["to_state"]) for e in api.get(f"{JOBS}/{second['id']}/events").json()]
    assert events[:2] == [(None, "waiting"), ("waiting", "queued")]


def test_a_dependency_that_fails_cancels_the_chain_naming_it(api: TestClient, fake: FakeBackend) -> None:
    first = submit(api, name="prepare")["id"]
    second = submit(api, name="train", after=[first])["id"]
    third = submit(api, name="evaluate", after=[second])["id"]
    cleanup = submit(api, name="cleanup", after=[{"job": first, "on": "failed"}])["id"]
    always = submit(api, name="report", after=[{"job": first, "on": "ended"}])["id"]
    wait_state(api, first, "running")
    fake.set_status(first, JobState.failed, "boom", exit_code=1)

    cancelled = wait_state(api, second, "cancelled")
    assert cancelled["reason"] == f"dependency job {first} (prepare) failed; this job needed it to succeed"
    downstream = wait_state(api, third, "cancelled")
    assert downstream["reason"].startswith(f"dependency job {second} (train) cancelled")
    wait_state(api, cleanup, "running")  # it ran *because* prepare failed
    wait_state(api, always, "running")


def test_a_retried_dependency_is_waited_out(api: TestClient, fake: FakeBackend) -> None:
    first = submit(api, name="train", retries=FAST_RETRY)["id"]
    second = submit(api, name="evaluate", after=[first])["id"]
    wait_state(api, first, "running")
    fake.set_status(first, JobState.failed, "node lost", exit_code=1, kind="node_failure")
    wait_state(api, first, "retrying")
    assert get_job(api, second)["state"] == "waiting"  # not an ending: the retry is waited out
    wait_state(api, first, "running")
    assert get_job(api, second)["state"] == "waiting"
    fake.finish(first, None)
    wait_state(api, second, "running")


def test_after_names_only_jobs_the_submitter_may_see(api: TestClient) -> None:
    mine = submit(api)["id"]
    theirs = api.post(JOBS, json={"name": "x", "entrypoint": "worker.tasks.seed:ddp_step"},
                      headers=login_headers(api.app, "mallory"))  # fmt: skip
    assert theirs.status_code == 201, theirs.text
    for after, position in (([mine, 10**9], 1), ([theirs.json()["id"]], 0)):
        response = api.post(
            JOBS, json={"name": "y", "entrypoint": "worker.tasks.seed:ddp_step", "after": after}
        )
        assert response.status_code == 404, response.text
        [detail] = response.json()["detail"]
        assert detail["loc"] == ["body", "after", str(position)] and detail["msg"].startswith(
            f"after.{position}"
        )
    twice = api.post(
        JOBS, json={"name": "y", "entrypoint": "worker.tasks.seed:ddp_step", "after": [mine, mine]}
    )
    assert twice.status_code == 422 and "after.1 names job" in twice.text
    wrong_on = {"name": "y", "entrypoint": "worker.tasks.seed:ddp_step", "after": [{"job": mine, "on": "x"}]}
    assert api.post(JOBS, json=wrong_on).status_code == 422


def test_a_waiting_job_is_cancelled_at_once(api: TestClient, fake: FakeBackend) -> None:
    first = submit(api)["id"]
    second = submit(api, after=[first])["id"]
    response = api.post(f"{JOBS}/{second}/cancel")
    assert response.status_code == 200, response.text
    assert get_job(api, second)["state"] == "cancelled"
    wait_state(api, first, "running")
    fake.finish(first, None)
    wait_state(api, first, "succeeded")
    assert get_job(api, second)["state"] == "cancelled" and second not in fake.specs


def test_jobs_still_waiting_never_crowd_out_one_that_can_go(
    api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settling pass reads a batch of waiting jobs: only those that move, so that many jobs waiting
    on a running dependency (with another already done) never fill it."""
    monkeypatch.setattr(dependencies, "SETTLE_BATCH", 2)
    done, running = submit(api)["id"], submit(api)["id"]
    wait_state(api, done, "running")
    wait_state(api, running, "running")
    fake.finish(done, None)
    wait_state(api, done, "succeeded")
    stuck = [submit(api, after=[done, running])["id"] for _ in range(3)]
    ready = submit(api, after=[done])["id"]
    wait_state(api, ready, "running")
    assert {get_job(api, job_id)["state"] for job_id in stuck} == {"waiting"}
