"""Pipelines through the API with the loops running against fake backends: a stage graph checked
naming the field, stored whole or not at all, once per Idempotency-Key; stages run after one another
(their jobs' `after`); the pipeline's state follows its stages'; cancel; a failing stage cancels what
follows it, naming why; `retry --from` runs that stage and all after it again."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlmodel import Session, col, func, select

from service.ledger.db import session_scope
from service.ledger.models.access import UserQuota
from service.ledger.models.jobs import Job
from service.ledger.models.pipelines import JobDependency, Pipeline, PipelineStage
from service.states import JobState
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import get_job, runtime_of, wait_for, wait_state

PIPELINES = "/api/v1/pipelines"
TASK = "worker.tasks.seed:ddp_step"


def three_stages(**train: Any) -> dict[str, Any]:
    return {
        "name": "demo",
        "stages": [
            {"name": "prepare", "job": {"entrypoint": TASK}},
            {"name": "train", "after": ["prepare"],
             "job": {"entrypoint": TASK, "backend": "slurm", "resources": {"nodes": 2}, **train}},
            {"name": "evaluate", "job": {"entrypoint": TASK}, "after": ["train"]},
        ],
    }  # fmt: skip


def create(api: TestClient, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = api.post(PIPELINES, json=body, headers=headers)
    assert response.status_code == 201, response.text
    made: dict[str, Any] = response.json()
    return made


def stages_of(pipeline: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {stage["name"]: stage for stage in pipeline["stages"]}


def get_pipeline(api: TestClient, pipeline_id: int) -> dict[str, Any]:
    response = api.get(f"{PIPELINES}/{pipeline_id}")
    assert response.status_code == 200, response.text
    found: dict[str, Any] = response.json()
    return found


def wait_pipeline(api: TestClient, pipeline_id: int, state: str) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        pipeline = get_pipeline(api, pipeline_id)
        return pipeline if pipeline["state"] == state else None

    return wait_for(probe, 10, f"pipeline {pipeline_id} to be {state}")


def counts(api: TestClient) -> tuple[int, int, int]:
    with Session(runtime_of(api).engine) as session:
        return (
            session.exec(select(func.count()).select_from(Pipeline)).one(),
            session.exec(select(func.count()).select_from(PipelineStage)).one(),
            session.exec(select(func.count()).select_from(Job)).one(),
        )


def test_stages_run_one_after_another_and_the_pipeline_succeeds(
    api: TestClient, fake: FakeBackend, fake_slurm: FakeBackend
) -> None:
    made = create(api, three_stages())
    assert made["state"] == "running" and made["finished_at"] is None
    stages = stages_of(made)
    assert [s["name"] for s in made["stages"]] == ["prepare", "train", "evaluate"]
    assert stages["train"]["after"] == ["prepare"] and stages["train"]["kind"] == "job"
    prepare, train, evaluate = (stages[name]["job_id"] for name in ("prepare", "train", "evaluate"))
    assert stages["train"]["state"] == "waiting" and stages["evaluate"]["state"] == "waiting"
    job = get_job(api, train)
    assert (job["name"], job["stage"], job["pipeline_id"], job["backend"]) == (
        "train",
        "train",
        made["id"],
        "slurm",
    )
    assert job["reason"] == f"waiting for job {prepare} to succeed"

    wait_state(api, prepare, "running")
    fake.finish(prepare, {"rows": 8})
    wait_state(api, train, "pending")
    assert fake_slurm.specs[train].upstream[0].stage == "prepare"
    fake_slurm.set_status(train, JobState.running)
    wait_state(api, train, "running")
    fake_slurm.finish(train, {"loss": 0.1})
    wait_state(api, evaluate, "running")
    assert get_pipeline(api, made["id"])["state"] == "running"
    fake.finish(evaluate, {"accuracy": 1.0})
    done = wait_pipeline(api, made["id"], "succeeded")
    assert done["finished_at"] is not None and done["reason"] is None
    assert {s["state"] for s in done["stages"]} == {"succeeded"}


def test_the_graph_is_checked_naming_the_field(api: TestClient) -> None:
    job = {"entrypoint": TASK}
    cases = [
        ([{"name": "a", "job": job}, {"name": "a", "job": job}], ["stages", "1", "name"]),
        ([{"name": "a", "job": job, "sweep": {"job": job, "grid": {"x": [1]}}}], ["stages", "0"]),
        ([{"name": "a"}], ["stages", "0"]),
        (
            [{"name": "a", "job": job}, {"name": "b", "job": job, "after": ["a", "c"]}],
            ["stages", "1", "after", "1"],
        ),
        ([{"name": "a", "job": job, "after": ["a"]}], ["stages", "0", "after", "0"]),
        (
            [{"name": "a", "job": job, "after": ["b"]}, {"name": "b", "job": job, "after": ["a"]}],
            ["stages", "0", "after", "0"],
        ),
        (
            [{"name": "a", "job": {**job, "resources": {"nodes": 99}}}],
            ["stages", "0", "job", "resources", "nodes"],
        ),
        ([{"name": "a", "job": {"entrypoint": TASK, "bogus": 1}}], ["stages", "0", "job", "bogus"]),
        (
            [{"name": "a", "job": job, "after": []}, {"name": "s", "sweep": {"job": job}}],
            ["stages", "1", "sweep", "grid"],
        ),
        ([{"name": "a", "job": {**job, "after": [10**9]}}], ["stages", "0", "job", "after", "0"]),
    ]
    for stages, loc in cases:
        response = api.post(PIPELINES, json={"name": "p", "stages": stages})
        assert response.status_code in (404, 422), response.text
        [detail] = response.json()["detail"]
        assert detail["loc"] == ["body", *loc], (stages, response.text)
    assert counts(api) == (0, 0, 0)


def test_stored_whole_or_not_at_all(api: TestClient) -> None:
    bad_third = three_stages()
    bad_third["stages"][2]["job"]["resources"] = {"gpus_per_node": 99}
    response = api.post(PIPELINES, json=bad_third)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "stages", "2", "job", "resources", "gpus_per_node"]
    assert counts(api) == (0, 0, 0)

    # Quota: every job of it counts, at once (3 stages, one a sweep of 3 trials: 5 jobs, 4 allowed).
    _limit(api, "alice", 4)
    body = three_stages()
    body["stages"][1] = {"name": "train", "sweep": {"job": {"entrypoint": TASK}, "grid": {"lr": [1, 2, 3]}},
                         "after": ["prepare"]}  # fmt: skip
    response = api.post(PIPELINES, json=body)
    assert response.status_code == 429, response.text
    assert counts(api) == (0, 0, 0)
    body["stages"][1]["sweep"]["grid"] = {"lr": [1, 2]}
    made = create(api, body)
    sweep_stage = stages_of(made)["train"]
    assert sweep_stage["kind"] == "sweep" and sweep_stage["sweep_id"] is not None
    assert counts(api) == (1, 3, 4)
    with Session(runtime_of(api).engine) as session:  # evaluate runs after every trial of the sweep
        evaluate = stages_of(made)["evaluate"]["job_id"]
        upstream = session.exec(
            select(JobDependency.upstream_id).where(col(JobDependency.job_id) == evaluate)
        )
        trials = session.exec(select(Job.id).where(col(Job.sweep_id) == sweep_stage["sweep_id"]))
        assert sorted(upstream) == sorted(trials)


def _limit(api: TestClient, user: str, most: int) -> None:
    runtime = runtime_of(api)
    with session_scope(runtime.engine) as session:
        session.add(UserQuota(username=user, max_active_jobs=most))
    runtime.quotas.refresh(user)


def test_an_idempotency_key_makes_it_once(api: TestClient) -> None:
    key = {"Idempotency-Key": "pipe-1"}
    first = create(api, three_stages(), **key)
    again = api.post(PIPELINES, json=three_stages(), headers=key)
    assert again.status_code == 200 and again.json()["id"] == first["id"], again.text
    assert counts(api) == (1, 3, 3)
    other = api.post(PIPELINES, json={**three_stages(), "name": "other"}, headers=key)
    assert other.status_code == 409 and "Idempotency-Key" in other.text


def test_lists_and_reads_only_ones_own(api: TestClient, login: Login) -> None:
    mine = create(api, three_stages())
    theirs = create(api, three_stages(), **login("bob"))
    assert api.get(f"{PIPELINES}/{theirs['id']}").status_code == 404
    page = api.get(PIPELINES).json()
    assert [p["id"] for p in page["items"]] == [mine["id"]]
    everyone = api.get(PIPELINES, headers=login("root", admin=True)).json()
    assert [p["id"] for p in everyone["items"]] == [theirs["id"], mine["id"]]
    first = api.get(PIPELINES, params={"limit": 1}, headers=login("root", admin=True)).json()
    rest = api.get(PIPELINES, params={"limit": 1, "cursor": first["next_cursor"]},
                   headers=login("root", admin=True)).json()  # fmt: skip
    assert [p["id"] for p in first["items"] + rest["items"]] == [theirs["id"], mine["id"]]
    assert api.post(f"{PIPELINES}/{theirs['id']}/cancel").status_code == 404


def test_cancel_ends_what_has_not_ended(api: TestClient, fake: FakeBackend) -> None:
    made = create(api, three_stages())
    prepare = stages_of(made)["prepare"]["job_id"]
    wait_state(api, prepare, "running")
    response = api.post(f"{PIPELINES}/{made['id']}/cancel")
    assert response.status_code == 200, response.text
    done = wait_pipeline(api, made["id"], "cancelled")
    assert done["reason"] == "cancelled by user" and done["finished_at"] is not None
    assert {s["state"] for s in done["stages"]} == {"cancelled"}
    assert api.post(f"{PIPELINES}/{made['id']}/cancel").status_code == 200  # idempotent


def test_a_failing_middle_stage_cancels_the_rest_and_retry_from_reruns_it(
    api: TestClient, fake: FakeBackend, fake_slurm: FakeBackend
) -> None:
    made = create(api, three_stages())
    ids = {name: stage["job_id"] for name, stage in stages_of(made).items()}
    wait_state(api, ids["prepare"], "running")
    fake.finish(ids["prepare"], None)
    wait_state(api, ids["train"], "pending")
    fake_slurm.set_status(ids["train"], JobState.failed, "boom", exit_code=1)
    failed = wait_pipeline(api, made["id"], "failed")
    assert failed["reason"].startswith("stage 'train' failed: ")
    evaluate = get_job(api, ids["evaluate"])
    assert evaluate["state"] == "cancelled"
    assert evaluate["reason"].startswith(f"dependency job {ids['train']} (train) failed")

    refused = api.post(f"{PIPELINES}/{made['id']}/retry", json={"from": "nope"})
    assert refused.status_code == 422 and refused.json()["detail"][0]["loc"] == ["body", "from"]
    again = api.post(f"{PIPELINES}/{made['id']}/retry", json={"from": "train"})
    assert again.status_code == 200, again.text
    rerun = again.json()
    assert rerun["state"] == "running" and rerun["finished_at"] is None and rerun["reason"] is None
    now = stages_of(rerun)
    assert now["prepare"]["job_id"] == ids["prepare"] and now["prepare"]["runs"] == 1
    assert now["train"]["job_id"] != ids["train"] and now["train"]["runs"] == 2
    assert now["evaluate"]["job_id"] != ids["evaluate"] and now["evaluate"]["runs"] == 2
    busy = api.post(f"{PIPELINES}/{made['id']}/retry", json={"from": "evaluate"})
    assert busy.status_code == 409 and "evaluate" in busy.text

    train, evaluate_id = now["train"]["job_id"], now["evaluate"]["job_id"]
    wait_state(api, train, "pending")  # its upstream (prepare) had already succeeded
    assert fake_slurm.specs[train].upstream[0].job_id == ids["prepare"]
    fake_slurm.finish(train, None)
    wait_state(api, evaluate_id, "running")
    assert fake.specs[evaluate_id].upstream[0].job_id == train
    fake.finish(evaluate_id, None)
    done = wait_pipeline(api, made["id"], "succeeded")
    assert [s["state"] for s in done["stages"]] == ["succeeded"] * 3
    assert get_job(api, ids["train"])["state"] == "failed"  # the first run stays, as history
