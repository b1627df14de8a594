"""Resuming a trial early_stop stopped (POST /sweeps/{id}/trials/{n}/resume), against the fake
backend: a new job of the sweep, in the stopped trial's place, starting from its latest checkpoint;
409 naming the trial for one not stopped early (bit for bit with real processes:
tests/integration/test_sweep_resume_local.py)."""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi.testclient import TestClient
from sqlmodel import Session

from service.domain.transitions import record_transition
from service.ledger.db import write_scope
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.api.test_sweeps import SWEEPS
from tests.fakes import FakeBackend
from tests.support import get_job, runtime_of, wait_for

BODY = {
    "name": "curves",
    "job": {"entrypoint": "worker.tasks.curves:curve", "kwargs": {"steps": 90}},
    "grid": {"lr": [0.1, 0.01]},
    "early_stop": {"method": "asha", "min_steps": 10, "reduction_factor": 3, "max_steps": 90},
}


def prune(api: TestClient, job_id: int, checkpoint: str) -> None:
    """End the trial as the pruning pass does, its latest checkpoint recorded."""
    with write_scope(runtime_of(api).engine) as session:
        job = session.get(Job, job_id, with_for_update=True)
        assert job is not None
        job.latest_checkpoint = checkpoint
        record_transition(session, job, JobState.cancelled, "pruned at rung 0 (step 10): loss 1, the cut 0.5",
                          kind="pruned")  # fmt: skip


def test_a_pruned_trial_resumes_as_a_new_job_from_its_checkpoint(api: TestClient, fake: FakeBackend) -> None:
    sweep = api.post(SWEEPS, json=BODY).json()
    first, second = (trial["job_id"] for trial in sweep["trials"])
    wait_for(lambda: get_job(api, first)["state"] == "running", 10, "running")
    prune(api, first, "/data/jobs/1/checkpoints/ckpt-16.pt")

    response = api.post(f"{SWEEPS}/{sweep['id']}/trials/0/resume")
    assert response.status_code == 201, response.text
    read: dict[str, Any] = response.json()
    trials = read["trials"]
    assert len(trials) == 2 and trials[1]["job_id"] == second  # in the stopped trial's place
    resumed = trials[0]
    assert resumed["job_id"] not in (first, second)
    assert (resumed["name"], resumed["params"]) == ("curves[0]", {"lr": 0.1})
    job = get_job(api, resumed["job_id"])
    assert job["spec"] == get_job(api, first)["spec"] and job["sweep_id"] == sweep["id"]
    spec = wait_for(lambda: fake.specs.get(resumed["job_id"]), 10, "dispatched")
    assert spec.resume_from == "/data/jobs/1/checkpoints/ckpt-16.pt"
    with Session(runtime_of(api).engine) as session:
        row = session.get(Job, resumed["job_id"])
        assert row is not None and row.resumes == first
    assert get_job(api, first)["state"] == "cancelled"  # the stopped trial's ending stands

    again = api.post(f"{SWEEPS}/{sweep['id']}/trials/0/resume")  # the resumed one was not stopped
    assert again.status_code == 409, again.text
    assert again.json()["detail"][0]["loc"] == ["trial"]
    assert "trial 0" in again.json()["detail"][0]["msg"]


def test_a_trial_not_stopped_early_is_409_naming_it(api: TestClient) -> None:
    sweep = api.post(SWEEPS, json=BODY).json()
    running = api.post(f"{SWEEPS}/{sweep['id']}/trials/1/resume")
    assert running.status_code == 409, running.text
    assert "trial 1" in running.json()["detail"][0]["msg"]
    with write_scope(runtime_of(api).engine) as session:  # cancelled by its user: not pruned either
        job = session.get(Job, sweep["trials"][1]["job_id"], with_for_update=True)
        assert job is not None
        record_transition(session, job, JobState.cancelled, "cancelled by alice", kind="cancel")
    cancelled = api.post(f"{SWEEPS}/{sweep['id']}/trials/1/resume")
    assert cancelled.status_code == 409 and "cancel" in cancelled.json()["detail"][0]["msg"]
    missing = api.post(f"{SWEEPS}/{sweep['id']}/trials/7/resume")
    assert missing.status_code == 404, missing.text
    assert api.post(f"{SWEEPS}/999/trials/0/resume").status_code == 404


def report(api: TestClient, fake: FakeBackend, job_id: int, loss: float) -> None:
    """The trial reports `loss` at steps 1 to 10 (rung 0 is step 10), read into the ledger."""
    spec = fake.specs[job_id]
    lines = [
        {"step": step, "total": 90, "metrics": {"loss": loss}, "time": time.time(), "attempt": spec.attempt}
        for step in range(1, 11)
    ]
    spec.files.progress.write_text("".join(json.dumps(line) + "\n" for line in lines))
    wait_for(lambda: get_job(api, job_id)["progress"], 10, "its reports read")


def test_early_stopping_does_not_judge_a_resumed_trial(api: TestClient, fake: FakeBackend) -> None:
    """Behind the cut at rung 0, a resumed trial runs on: it was judged once, and resumed to its end."""
    sweep = api.post(SWEEPS, json=BODY).json()
    first, second = (trial["job_id"] for trial in sweep["trials"])
    wait_for(lambda: get_job(api, second)["state"] == "running", 10, "running")
    prune(api, first, "/data/jobs/1/checkpoints/ckpt-16.pt")
    report(api, fake, second, 0.1)  # the best at rung 0
    resumed = api.post(f"{SWEEPS}/{sweep['id']}/trials/0/resume").json()["trials"][0]["job_id"]
    wait_for(lambda: get_job(api, resumed)["state"] == "running", 10, "the resumed trial running")
    report(api, fake, resumed, 5.0)  # far behind: a trial judged here would be stopped
    ticks = runtime_of(api).reconciler.ticks["local"]
    wait_for(lambda: runtime_of(api).reconciler.ticks["local"] >= ticks + 5, 10, "a few ticks")
    assert get_job(api, resumed)["state"] == "running"


def test_a_resume_counts_against_the_owners_unfinished_jobs(api: TestClient) -> None:
    sweep = api.post(SWEEPS, json=BODY).json()
    first = sweep["trials"][0]["job_id"]
    wait_for(lambda: get_job(api, first)["state"] == "running", 10, "running")
    prune(api, first, "/data/jobs/1/checkpoints/ckpt-16.pt")
    runtime_of(api).settings.max_active_jobs_per_user = 1  # trial 1 is unfinished: no room for another
    refused = api.post(f"{SWEEPS}/{sweep['id']}/trials/0/resume")
    assert refused.status_code == 429, refused.text
    assert "limit is 1" in refused.json()["detail"][0]["msg"]
    runtime_of(api).settings.max_active_jobs_per_user = 2
    assert api.post(f"{SWEEPS}/{sweep['id']}/trials/0/resume").status_code == 201
