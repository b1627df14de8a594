"""Restarts in place as the service sees them (issue 44): the spec's `restarts` and
`resources.spare_nodes`, the supervisor's restarts.jsonl read into the job (count, events, placement,
goodput, a `job.restarted` webhook) past hostile lines, a give-up in the attempt's ending, and the
watchdog asking for a restart of a hung run instead of ending it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.config import Settings
from service.states import JobState
from tests.api.test_watchdog_loop import WATCH, later, quiet_service, running, stand_still, tick
from tests.fakes import FakeBackend
from tests.support import JOBS, get_job, runtime_of, submit, wait_for, wait_state
from worker.spec import RestartPolicy, parse_restart_request

SUBSCRIPTIONS = "/api/v1/notifications/subscriptions"
DELIVERIES = "/api/v1/notifications/deliveries"


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "webhook_hosts": ["127.0.0.1"],
            "webhook_private_hosts": ["127.0.0.1"],
            "webhook_ports": ["1-65535"],
            "notify_interval_s": 0.05,
        }
    )


@pytest.fixture
def quiet_api(settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend) -> Iterator[TestClient]:
    with quiet_service(settings, fake, fake_slurm) as client:
        yield client


def restarted(restart: int = 1, attempt: int = 1, **fields: Any) -> dict[str, Any]:
    now = time.time()
    record = {"attempt": attempt, "restart": restart, "outcome": "restarted", "cause": "node_failure",
              "rank": 1, "node": "n2", "detail": "node down", "lost_at": now - 6.2, "started_at": now,
              "resumed_from": "/jobs/1/checkpoints/ckpt-40.pt", "resumed_step": 40, "nodes": ["n1", "n3"],
              "max": 2}  # fmt: skip
    return {**record, **fields}


def append(fake: FakeBackend, job_id: int, *lines: str | dict[str, Any]) -> None:
    with fake.specs[job_id].files.restarts.open("a") as out:
        for line in lines:
            out.write((line if isinstance(line, str) else json.dumps(line)) + "\n")


def events(api: TestClient, job_id: int) -> list[str]:
    return [one["reason"] or "" for one in api.get(f"{JOBS}/{job_id}/events").json()]


def test_the_spec_takes_a_restart_policy_and_spare_nodes_and_shows_them(
    api: TestClient, fake: FakeBackend, fake_slurm: FakeBackend
) -> None:
    job = submit(api, restarts={"max": 3, "on": ["node_failure", "failure"]})
    assert job["restarts"] == {"max": 3, "on": ["node_failure", "failure"]} and job["restart_count"] == 0
    wait_state(api, job["id"], "running")
    assert fake.specs[job["id"]].restarts == RestartPolicy(max=3, on=["node_failure", "failure"])

    plain = submit(api)
    assert plain["restarts"] == {"max": 2, "on": ["node_failure", "hang"]}

    spared = submit(api, backend="slurm", resources={"nodes": 2, "spare_nodes": 1})
    wait_for(lambda: fake_slurm.specs.get(spared["id"]), what="the slurm submission")
    assert fake_slurm.specs[spared["id"]].resources.spare_nodes == 1


@pytest.mark.parametrize(
    ("fields", "loc", "words"),
    [
        ({"restarts": {"on": ["preemption"]}}, ["body", "restarts", "on", 0], "node_failure"),
        ({"restarts": {"max": -1}}, ["body", "restarts", "max"], "greater than or equal"),
        ({"restarts": {"max": 1, "when": "always"}}, ["body", "restarts", "when"], "Extra inputs"),
        ({"restarts": {"on": ["hang", "hang"]}}, ["body", "restarts", "on"], "twice"),
        ({"resources": {"spare_nodes": 65}}, ["body", "resources", "spare_nodes"], "less than or equal"),
        ({"resources": {"spare_nodes": 1}}, ["body", "resources", "spare_nodes"], "no room for 1 spare"),
    ],
)
def test_a_bad_restart_field_is_refused_naming_it(
    api: TestClient, fields: dict[str, Any], loc: list[Any], words: str
) -> None:
    body = {"name": "x", "entrypoint": "worker.tasks.seed:ddp_step", **fields}
    response = api.post(JOBS, json=body)
    assert response.status_code == 422, response.text
    (detail,) = response.json()["detail"]
    assert detail["loc"] == loc and words in detail["msg"], detail


def test_restarts_are_read_into_the_job_past_hostile_lines_and_told(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    hook = quiet_api.post(SUBSCRIPTIONS, json={"url": "http://127.0.0.1:9/hook", "on": ["restarted"]})
    assert hook.status_code == 201, hook.text
    job_id = running(quiet_api, watchdog=None)
    append(
        fake, job_id,
        "x" * 100_000,  # no record: skipped whole
        '{"attempt": 1, "restart": 1, "outcome": "restarted", "cause": "node_failure", "lost_at": NaN}'[:-1],
        restarted(attempt=7),  # another attempt's
        restarted(detail="node\u0000down", node="bad\nname"),
        restarted(),  # the same restart written twice: counted once
        '{"attempt": 1, "restart": 2, "outcome": "restarted", "cause": "nonsense"}',
        "[1, 2, 3]",
    )  # fmt: skip
    tick(quiet_api)

    job = get_job(quiet_api, job_id)
    assert job["state"] == "running" and job["restart_count"] == 1 and job["attempt"] == 1
    assert events(quiet_api, job_id)[-1] == (
        "rank 1 lost (nodedown); restarted in place on n1,n3 in 6.2 s from step 40, restart 1 of 2"
    )
    assert job["goodput"]["downtime_s"] > 0 and job["goodput"]["accruing"] == "downtime"

    append(fake, job_id, restarted(restart=2, rank=0, node="n1", resumed_step=None, resumed_from=None))
    fake.specs[job_id].files.progress.write_text(
        json.dumps({"step": 1, "attempt": 1, "time": time.time() + 1}) + "\n"
    )
    tick(quiet_api)
    job = get_job(quiet_api, job_id)
    assert job["restart_count"] == 2 and job["goodput"]["accruing"] == "training"
    assert events(quiet_api, job_id)[-1].endswith("in 6.2 s from the start, restart 2 of 2")
    assert job["goodput"]["recomputed_s"] >= 0 and job["goodput"]["ratio"] is not None

    told = wait_for(lambda: [d for d in quiet_api.get(DELIVERIES).json() if d["job_id"] == job_id] or None)
    assert {one["event"] for one in told} == {"job.restarted"}


def test_recomputed_work_runs_from_the_save_of_the_checkpoint_resumed_from(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    job_id = running(quiet_api, watchdog=None)
    files, t0 = fake.specs[job_id].files, time.time()
    saved = {"checkpoint": "/j/checkpoints/ckpt-3.pt", "step": 3, "time": t0 + 0.3, "attempt": 1}
    files.progress.write_text(json.dumps(saved) + "\n")
    tick(quiet_api)
    time.sleep(1.2)  # trained on; lost at t0 + 1.0
    lost = restarted(lost_at=t0 + 1.0, started_at=t0 + 1.1, resumed_from=saved["checkpoint"], resumed_step=3)
    append(fake, job_id, lost)
    tick(quiet_api)

    kept = get_job(quiet_api, job_id)["goodput"]
    assert kept["recomputed_s"] == pytest.approx(0.7, abs=0.01)  # trained from its save to the loss
    assert set(kept) == {"training_s", "downtime_s", "recomputed_s", "queue_s", "ratio", "as_of", "accruing"}


def test_a_supervisor_giving_up_says_why_in_the_ending_and_retries_requeue_it(
    api: TestClient, fake: FakeBackend
) -> None:
    job_id = submit(api, retries={"max": 1, "backoff_s": 3600})["id"]
    wait_state(api, job_id, "running")
    reason = "no spare node: the allocation holds 1 usable node of 2 needed"
    gave_up = {"attempt": 1, "restart": 1, "outcome": "gave_up", "cause": "node_failure", "reason": reason}
    append(fake, job_id, restarted(), gave_up)
    wait_for(lambda: get_job(api, job_id)["restart_count"] == 1 or None, what="the restart read")
    fake.set_status(job_id, JobState.failed, None, 1)  # the supervisor ends the attempt non-zero

    job = wait_state(api, job_id, "retrying")
    (ended,) = api.get(f"{JOBS}/{job_id}/attempts").json()[:1]
    assert ended["kind"] == "node_failure"
    assert ended["reason"].startswith(f"a rank lost (node_failure); not restarted in place: {reason}\n")
    assert "retry 1 of 1" in job["reason"]


def test_the_watchdog_asks_for_a_restart_in_place_of_a_hung_run_once(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    job_id = running(quiet_api, watchdog={**WATCH, "on_stall": "fail"}, retries={"max": 0})
    stand_still(fake, job_id)
    later(quiet_api, 100.0)
    tick(quiet_api)

    files = fake.specs[job_id].files
    wait_for(lambda: files.restart_request.exists() or None, 10, "the request")
    request = parse_restart_request(files.restart_request.read_bytes())
    assert request is not None and (request.attempt, request.run, request.cause) == (1, 0, "hang")
    assert request.detail.startswith("no progress for ")
    wait_for(lambda: "restart in place requested" in events(quiet_api, job_id)[-1] or None, 10, "the event")
    assert get_job(quiet_api, job_id)["state"] == "running"
    tick(quiet_api)
    assert [fake.external_id(job_id)] not in fake.cancel_calls  # not stopped

    append(fake, job_id, restarted(cause="hang", detail="stalled", rank=None, node=None))
    later(quiet_api, 0)
    tick(quiet_api)
    job = get_job(quiet_api, job_id)
    assert job["restart_count"] == 1 and job["stalled_at"] is None  # the new run's own time
    assert sum("restart in place requested" in one for one in events(quiet_api, job_id)) == 1


def test_a_hung_run_with_no_restarts_left_ends_as_before(quiet_api: TestClient, fake: FakeBackend) -> None:
    job_id = running(quiet_api, watchdog={**WATCH, "on_stall": "fail"}, retries={"max": 0},
                     restarts={"max": 1, "on": ["node_failure"]})  # fmt: skip
    stand_still(fake, job_id)
    later(quiet_api, 100.0)
    tick(quiet_api)
    wait_state(quiet_api, job_id, "failed")
    assert not fake.specs[job_id].files.restart_request.exists()
    assert runtime_of(quiet_api).reconciler.watch.stalls_total == 1
