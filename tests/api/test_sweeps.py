"""POST/GET /api/v1/sweeps against a fake backend: expansion, validation, idempotency, quotas, cancel."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from service.domain import cancel, metric_series
from service.ledger.models.access import UserQuota
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric
from service.ledger.models.sweeps import Sweep
from service.loops import sweep_claims
from service.states import JobState
from tests.conftest import Login
from tests.fakes import FakeBackend
from tests.support import JOBS, get_job, runtime_of, wait_for, wait_state
from worker.spec import ArrayGroup

SWEEPS = "/api/v1/sweeps"
TRAIN = "worker.tasks.train:train"


def sweep_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": "grid",
        "job": {"entrypoint": TRAIN, "kwargs": {"epochs": 1}},
        "grid": {"lr": [0.1, 0.01], "batch_size": [32, 64, 128]},
    }
    body.update(changes)
    return body


def stored_counts(api: TestClient) -> tuple[int, int]:
    with Session(runtime_of(api).engine) as session:
        sweeps = session.exec(select(func.count()).select_from(Sweep)).one()
        jobs = session.exec(select(func.count()).select_from(Job)).one()
    return int(sweeps), int(jobs)


def test_a_grid_makes_one_job_per_combination(api: TestClient, fake: FakeBackend) -> None:
    response = api.post(SWEEPS, json=sweep_body(max_parallel=2))
    assert response.status_code == 201, response.text
    sweep = response.json()
    assert sweep["size"] == 6 and len(sweep["trials"]) == 6
    assert sweep["counts"] == {"queued": 6} or sum(sweep["counts"].values()) == 6
    params = [trial["params"] for trial in sweep["trials"]]
    assert params == [
        {"lr": lr, "batch_size": size} for lr in (0.1, 0.01) for size in (32, 64, 128)
    ]  # the grid's product, last parameter fastest
    for index, trial in enumerate(sweep["trials"]):
        job = api.get(f"{JOBS}/{trial['job_id']}").json()
        assert job["name"] == f"grid[{index}]"
        assert job["sweep_id"] == sweep["id"] and job["params"] == trial["params"]
        assert job["spec"]["kwargs"] == {"epochs": 1, **trial["params"]}


def test_zip_lists_go_together_and_cross_the_grid(api: TestClient) -> None:
    body = sweep_body(grid={"seed": [1, 2]}, zip={"lr": [0.1, 0.2, 0.3], "wd": [0.0, 0.1, 0.2]})
    sweep = api.post(SWEEPS, json=body).json()
    assert [trial["params"] for trial in sweep["trials"]] == [
        {"seed": seed, "lr": lr, "wd": wd}
        for seed in (1, 2)
        for lr, wd in ((0.1, 0.0), (0.2, 0.1), (0.3, 0.2))
    ]


def test_script_args_take_parameters_through_placeholders(api: TestClient, tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    body = {"name": "s", "job": {"script": str(script), "args": ["--lr={lr}", "--flag", "{on}"]},
            "grid": {"lr": [0.5, 1e-3], "on": [True]}}  # fmt: skip
    sweep = api.post(SWEEPS, json=body)
    assert sweep.status_code == 201, sweep.text
    args = [api.get(f"{JOBS}/{t['job_id']}").json()["spec"]["args"] for t in sweep.json()["trials"]]
    assert args == [["--lr=0.5", "--flag", "true"], ["--lr=0.001", "--flag", "true"]]


@pytest.mark.parametrize(
    ("changes", "loc", "words"),
    [
        ({"grid": {}}, ["body", "grid"], "at least one parameter"),
        ({"grid": {"lr": []}}, ["body", "grid", "lr"], "at least one value"),
        ({"grid": {"epochs": [1, 2]}}, ["body", "grid", "epochs"], "also set in job.kwargs"),
        ({"grid": {}, "zip": {"a": [1, 2], "b": [1]}}, ["body", "zip"], "one length"),
        ({"grid": {"lr": [1]}, "zip": {"lr": [2]}}, ["body", "zip", "lr"], "in grid too"),
        ({"grid": {"x": list(range(40)), "y": list(range(40))}}, ["body", "grid"], "1600 trials"),
        ({"grid": {}, "zip": {"x": list(range(1001))}}, ["body", "zip"], "1001 trials"),
        ({"name": "a\x00b"}, ["body", "name"], "NUL"),
        ({"metric": "a\x00b"}, ["body", "metric"], "NUL"),
        ({"grid": {"bad-name": [1]}}, ["body", "grid", "bad-name"], "parameter name"),
        ({"job": {"name": "x", "entrypoint": TRAIN}}, ["body", "job", "name"], "None"),
        ({"max_parallel": 0}, ["body", "max_parallel"], "greater than or equal to 1"),
        ({"goal": "lowest"}, ["body", "goal"], "'min' or 'max'"),
    ],
)
def test_bad_sweeps_name_the_field_and_store_nothing(
    api: TestClient, changes: dict[str, Any], loc: list[str], words: str
) -> None:
    runtime_of(api).settings.max_sweep_trials = 1000
    response = api.post(SWEEPS, json=sweep_body(**changes))
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"][: len(loc)] == loc, detail
    assert words in detail["msg"], detail
    assert stored_counts(api) == (0, 0)


def test_a_placeholder_must_name_a_parameter(api: TestClient, tmp_path: Any) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    unknown = {"name": "s", "job": {"script": str(script), "args": ["--lr={rate}"]}, "grid": {"lr": [1]}}
    response = api.post(SWEEPS, json=unknown)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "job", "args", "0"]
    unused = {"name": "s", "job": {"script": str(script), "args": []}, "grid": {"lr": [1]}}
    response = api.post(SWEEPS, json=unused)
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "grid", "lr"]
    assert stored_counts(api) == (0, 0)


def test_an_idempotency_key_makes_the_sweep_once(api: TestClient) -> None:
    first = api.post(SWEEPS, json=sweep_body(), headers={"Idempotency-Key": "k1"})
    again = api.post(SWEEPS, json=sweep_body(), headers={"Idempotency-Key": "k1"})
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    other = api.post(SWEEPS, json=sweep_body(name="other"), headers={"Idempotency-Key": "k1"})
    assert other.status_code == 409 and other.json()["detail"][0]["loc"] == ["Idempotency-Key"]
    assert stored_counts(api) == (1, 6)


def test_trials_count_against_the_unfinished_jobs_quota(api: TestClient, fake: FakeBackend) -> None:
    runtime_of(api).settings.max_active_jobs_per_user = 8
    assert api.post(SWEEPS, json=sweep_body()).status_code == 201  # six trials: room for two more
    response = api.post(SWEEPS, json=sweep_body())  # it fits once some of them finish
    assert response.status_code == 429, response.text
    assert "6 more" in response.json()["detail"][0]["msg"] and response.headers["Retry-After"]
    assert stored_counts(api) == (1, 6)
    assert api.post(SWEEPS, json=sweep_body(grid={"lr": [1, 2]})).status_code == 201


@pytest.mark.parametrize(("changes", "field"), [({}, "grid"), ({"grid": {}, "zip": {"lr": [1] * 6}}, "zip")])
def test_a_sweep_of_more_trials_than_the_unfinished_jobs_limit_is_403(
    api: TestClient, changes: dict[str, Any], field: str
) -> None:
    """Not 429: however long the user waits, six trials never fit under a limit of five."""
    runtime_of(api).settings.max_active_jobs_per_user = 5
    response = api.post(SWEEPS, json=sweep_body(**changes))
    assert response.status_code == 403, response.text
    assert "Retry-After" not in response.headers
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", field] and "6 jobs" in detail["msg"] and "limit of 5" in detail["msg"]
    assert stored_counts(api) == (0, 0)


@pytest.mark.parametrize(
    ("job", "status", "loc"),
    [
        ({"resources": {"nodes": 99}}, 422, ["body", "job", "resources", "nodes"]),
        ({"resources": {"nodes": 0}}, 422, ["body", "job", "resources", "nodes"]),  # pydantic's own
        ({"entrypoint": "os:system"}, 403, ["body", "job", "entrypoint"]),
        ({"env": {"LD_PRELOAD": "x"}}, 403, ["body", "job", "env", "LD_PRELOAD"]),
        ({"env": {"A.B": "x"}}, 422, ["body", "job", "env", "A.B"]),
    ],
)
def test_errors_about_the_sweeps_job_name_the_field_under_job(
    api: TestClient, job: dict[str, Any], status: int, loc: list[str]
) -> None:
    """The checks one job's admission makes name a job's fields; a sweep's body has them under `job`,
    where pydantic's own errors about the same body put them too."""
    response = api.post(SWEEPS, json=sweep_body(job={"entrypoint": TRAIN, **job}))
    assert response.status_code == status, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == loc, detail
    assert stored_counts(api) == (0, 0)


def test_a_users_own_job_size_limit_names_the_field_under_job(api: TestClient) -> None:
    with Session(runtime_of(api).engine) as session, session.begin():
        session.add(UserQuota(username="alice", max_nodes=1))
    job = {"entrypoint": TRAIN, "backend": "slurm", "resources": {"nodes": 2}}
    response = api.post(SWEEPS, json=sweep_body(job=job))
    assert response.status_code == 403, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "job", "resources", "nodes"]


def test_what_a_sweeps_trials_hold_together_is_limited(api: TestClient, tmp_path: Any) -> None:
    """Each job is held to 256 KiB; a sweep multiplies what it stores by its trials (and a parameter's
    values by the trials that take them)."""
    runtime_of(api).settings.max_sweep_bytes = 20_000
    big = {"entrypoint": TRAIN, "kwargs": {"blob": "x" * 5_000}}
    response = api.post(SWEEPS, json=sweep_body(job=big, grid={"lr": [1, 2, 3, 4]}))  # 4 x 5 KB
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "job", "kwargs"] and "20000" in detail["msg"], detail
    values = {"blob": ["x" * 5_000, "y"], "seed": [1, 2, 3]}  # 3 x 5 KB: the one large value, three times
    response = api.post(SWEEPS, json=sweep_body(grid=values))
    assert response.status_code == 201, response.text
    response = api.post(SWEEPS, json=sweep_body(grid={**values, "seed": [1, 2, 3, 4]}))
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "job", "kwargs"]
    script = tmp_path / "train.py"
    script.write_text("")
    job = {"script": str(script), "args": ["--blob={blob}", "--again={blob}", "--seed={seed}"]}
    response = api.post(SWEEPS, json=sweep_body(job=job, grid={"blob": ["x" * 5_000], "seed": [1, 2]}))
    assert response.status_code == 422 and response.json()["detail"][0]["loc"] == ["body", "job", "args"]
    assert stored_counts(api) == (1, 6)


def test_a_sweeps_cancel_frees_its_room_at_once(api: TestClient, fake: FakeBackend) -> None:
    runtime_of(api).settings.max_active_jobs_per_user = 6
    first = api.post(SWEEPS, json=sweep_body()).json()  # six trials: the whole room
    assert api.post(SWEEPS, json=sweep_body()).status_code == 429

    def submitted() -> bool:
        return all(get_job(api, trial["job_id"])["external_id"] for trial in first["trials"])

    # Out of the dispatcher's hands: a cancel that meets a trial mid-dispatch only flags it, and the
    # dispatcher ends it a moment later.
    wait_for(submitted, what="every trial submitted")

    api.post(f"{SWEEPS}/{first['id']}/cancel")

    again = api.post(SWEEPS, json=sweep_body())
    assert again.status_code == 201, again.text


def test_others_see_no_sweep_and_admins_see_all(api: TestClient, login: Login) -> None:
    sweep_id = api.post(SWEEPS, json=sweep_body()).json()["id"]
    bob = login("bob")
    assert api.get(f"{SWEEPS}/{sweep_id}", headers=bob).status_code == 404
    assert api.post(f"{SWEEPS}/{sweep_id}/cancel", headers=bob).status_code == 404
    assert api.get(SWEEPS, headers=bob).json()["items"] == []
    admin = login("root", admin=True)
    assert api.get(f"{SWEEPS}/{sweep_id}", headers=admin).status_code == 200
    assert [one["id"] for one in api.get(SWEEPS, headers=admin).json()["items"]] == [sweep_id]


def test_metric_last_best_and_the_best_trial(api: TestClient, fake: FakeBackend) -> None:
    sweep = api.post(SWEEPS, json=sweep_body(grid={"lr": [1, 2, 3]})).json()
    ids = [trial["job_id"] for trial in sweep["trials"]]
    losses = {ids[0]: [5.0, 1.0, 2.0], ids[1]: [4.0, 1.5], ids[2]: [9.0]}  # last: 2.0, 1.5, 9.0
    with Session(runtime_of(api).engine) as session, session.begin():
        for job_id, values in losses.items():  # as the reconciler stores them: rows, then their rollup
            for step, value in enumerate(values):
                session.add(JobMetric(job_id=job_id, step=step, name="loss", value=value))
            session.add(JobMetric(job_id=job_id, step=0, name="acc", value=0.5))
            session.flush()
            added = [("loss", 1, step) for step in range(len(values))] + [("acc", 1, 0)]
            metric_series.refresh_added(session.connection(), job_id, added)
    read = api.get(f"{SWEEPS}/{sweep['id']}").json()
    by_id = {trial["job_id"]: trial for trial in read["trials"]}
    assert [(by_id[i]["metric_last"], by_id[i]["metric_best"]) for i in ids] == [
        (2.0, 1.0),
        (1.5, 1.5),
        (9.0, 9.0),
    ]
    assert read["best"]["job_id"] == ids[1]  # the lowest final loss, not the lowest ever
    listed = api.get(SWEEPS).json()["items"][0]
    assert listed["best"]["job_id"] == ids[1] and listed["trials"] == []


def test_cancel_ends_every_unfinished_trial_with_one_backend_call(api: TestClient, fake: FakeBackend) -> None:
    sweep = api.post(SWEEPS, json=sweep_body()).json()
    ids = [trial["job_id"] for trial in sweep["trials"]]
    wait_for(lambda: all(api.get(f"{JOBS}/{i}").json()["external_id"] for i in ids), what="all submitted")
    calls_before = len(fake.cancel_calls)
    response = api.post(f"{SWEEPS}/{sweep['id']}/cancel")
    assert response.status_code == 200, response.text
    assert response.json()["counts"] == {"cancelled": 6}
    assert len(fake.cancel_calls) == calls_before + 1
    assert sorted(fake.cancel_calls[-1]) == sorted(fake.external_id(i) for i in ids)
    assert api.post(f"{SWEEPS}/{sweep['id']}/cancel").status_code == 200  # idempotent


def test_a_big_cancel_moves_its_trials_in_chunks_with_one_backend_call(
    api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another user's write waits for one chunk of a sweep's cancel at most, never for the whole
    cascade: each chunk is a transaction of its own; the scheduler is still told once."""
    monkeypatch.setattr(cancel, "CANCEL_CHUNK", 4)
    sessions: list[int] = []
    request_cancel = cancel._request_cancel

    def recorded(session: Session, job_id: int, viewer: Any) -> Job:
        sessions.append(id(session))
        return request_cancel(session, job_id, viewer)

    monkeypatch.setattr(cancel, "_request_cancel", recorded)
    sweep = api.post(SWEEPS, json=sweep_body(grid={"lr": [0.1, 0.2, 0.3], "batch_size": [8, 16, 32]})).json()
    ids = [trial["job_id"] for trial in sweep["trials"]]
    wait_for(lambda: all(api.get(f"{JOBS}/{i}").json()["external_id"] for i in ids), what="all submitted")
    calls_before = len(fake.cancel_calls)

    response = api.post(f"{SWEEPS}/{sweep['id']}/cancel")

    assert response.status_code == 200, response.text
    assert response.json()["counts"] == {"cancelled": 9}
    assert len(sessions) == 9 and len(set(sessions)) == 3  # 4 + 4 + 1, each in its own transaction
    assert len(fake.cancel_calls) == calls_before + 1


def test_on_an_array_backend_a_sweep_is_handed_over_whole(api: TestClient, fake_slurm: FakeBackend) -> None:
    runtime_of(api).settings.dispatch_batch_size = 4  # a sweep is not cut by the batch size
    body = sweep_body(job={"entrypoint": TRAIN, "backend": "slurm"}, max_parallel=3)
    sweep = api.post(SWEEPS, json=body).json()
    ids = sorted(trial["job_id"] for trial in sweep["trials"])
    wait_for(lambda: fake_slurm.submit_calls, what="a submission")
    assert [sorted(call) for call in fake_slurm.submit_calls] == [ids]
    expected = ArrayGroup(key=f"sweep-{sweep['id']}", max_parallel=3)
    assert all(fake_slurm.specs[job_id].group == expected for job_id in ids)


def test_on_an_array_backend_a_sweep_past_max_parallel_arrays_is_claimed_only_that_far(
    api: TestClient, fake_slurm: FakeBackend
) -> None:
    # Arrays of 2 (MaxArraySize), max_parallel 2: two arrays of %1 hold four trials; a third array
    # would run a third trial at once. The claim hands over four; the others wait queued, unclaimed,
    # and are not said to have failed a dispatch.
    fake_slurm.max_array_size = 2
    body = sweep_body(job={"entrypoint": TRAIN, "backend": "slurm"}, max_parallel=2)
    sweep = api.post(SWEEPS, json=body).json()
    ids = sorted(trial["job_id"] for trial in sweep["trials"])
    wait_for(lambda: fake_slurm.submit_calls, what="a submission")
    time.sleep(0.5)  # many dispatch intervals: nothing more while four trials are under way
    assert [sorted(call) for call in fake_slurm.submit_calls] == [ids[:4]]
    expected = ArrayGroup(key=f"sweep-{sweep['id']}", max_parallel=2)
    assert all(fake_slurm.specs[job_id].group == expected for job_id in ids[:4])
    for job_id in ids[4:]:
        with Session(runtime_of(api).engine) as session:
            job = session.get(Job, job_id)
            assert job is not None and job.state == "queued" and job.claimed_by is None
            assert "dispatch failed" not in (job.reason or "")
    for job_id in ids[:3]:  # one trial left under way: room for one more
        fake_slurm.finish(job_id, 0.5)
    wait_for(lambda: len(fake_slurm.submit_calls) == 2, what="the next trial, once there was room")
    assert fake_slurm.submit_calls[1:] == [[ids[4]]]


def test_on_an_array_backend_a_sweep_waits_while_the_array_size_is_unknown(
    api: TestClient, fake_slurm: FakeBackend
) -> None:
    fake_slurm.max_array_size = None  # the backend has not read it from the scheduler yet
    body = sweep_body(job={"entrypoint": TRAIN, "backend": "slurm"}, max_parallel=2)
    sweep = api.post(SWEEPS, json=body).json()
    ids = sorted(trial["job_id"] for trial in sweep["trials"])
    time.sleep(0.5)  # many dispatch intervals
    assert fake_slurm.submit_calls == []
    fake_slurm.max_array_size = 1001
    wait_for(lambda: fake_slurm.submit_calls, what="the sweep, once the size is known")
    assert [sorted(call) for call in fake_slurm.submit_calls] == [ids]  # whole, as one array


def test_locally_max_parallel_trials_run_at_once(api: TestClient, fake: FakeBackend) -> None:
    sweep = api.post(SWEEPS, json=sweep_body(max_parallel=2)).json()
    ids = [trial["job_id"] for trial in sweep["trials"]]

    def submitted() -> list[int]:
        return [job_id for call in fake.submit_calls for job_id in call]

    wait_for(lambda: len(submitted()) == 2, what="two trials submitted")
    time.sleep(0.5)  # many dispatch intervals: no third goes out while two are under way
    assert submitted() == ids[:2]
    fake.finish(ids[0], 1.0)
    wait_for(lambda: len(submitted()) == 3, what="the third trial, once the first ended")
    assert submitted() == ids[:3]
    other = api.post(JOBS, json={"name": "other", "entrypoint": TRAIN}).json()  # not starved by the sweep
    wait_for(lambda: other["id"] in submitted(), what="a job outside the sweep dispatched")


def test_a_sweep_committed_during_a_claim_is_still_held_to_max_parallel(
    api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim looks for sweeps waiting for room, then for the jobs to claim. On PostgreSQL each
    statement sees the commits made before it began: a sweep committed between the two was claimed
    whole (in one CI run: all six trials of a sweep of max_parallel 2)."""
    if runtime_of(api).engine.dialect.name != "postgresql":
        pytest.skip("SQLite's writers take turns: no commit falls inside the dispatcher's claim")
    made: list[dict[str, Any]] = []
    looked = sweep_claims.room_left

    def sweep_arrives_after_the_look(*args: Any) -> dict[int, int]:
        room = looked(*args)
        if not made:  # committed by the intake thread while the dispatcher's claim goes on
            made.append(api.post(SWEEPS, json=sweep_body(max_parallel=2)).json())
        return room

    monkeypatch.setattr(sweep_claims, "room_left", sweep_arrives_after_the_look)
    wait_for(lambda: made, what="the sweep, posted inside a claim")
    ids = [trial["job_id"] for trial in made[0]["trials"]]

    wait_for(lambda: fake.submit_calls, what="a submission")
    time.sleep(0.5)  # many dispatch intervals: no third goes out while two are under way
    assert [job_id for call in fake.submit_calls for job_id in call] == ids[:2]


def test_retries_apply_to_each_trial_on_its_own(api: TestClient, fake: FakeBackend) -> None:
    fast = {"max": 1, "backoff_s": 0.2, "on": ["node_failure"]}
    sweep = api.post(SWEEPS, json=sweep_body(grid={"lr": [1, 2]}, job={"entrypoint": TRAIN, "retries": fast}))
    first, second = (trial["job_id"] for trial in sweep.json()["trials"])
    wait_state(api, first, "running")
    wait_state(api, second, "running")
    fake.set_status(first, JobState.failed, "node failure", exit_code=1, kind="node_failure")
    wait_state(api, first, "retrying")
    retried = wait_state(api, first, "running")
    assert retried["attempt"] == 2 and retried["sweep_id"] == sweep.json()["id"]
    assert fake.specs[first].kwargs["lr"] == 1 and fake.specs[first].attempt == 2  # the same trial again
    assert api.get(f"{JOBS}/{second}").json()["attempt"] == 1  # the other trial is not touched
    fake.finish(first, 0.5)
    fake.finish(second, 0.7)
    wait_state(api, first, "succeeded")
    wait_state(api, second, "succeeded")
    assert api.get(f"{SWEEPS}/{sweep.json()['id']}").json()["counts"] == {"succeeded": 2}


def test_on_an_array_backend_a_retried_trial_waits_for_room_under_max_parallel(
    api: TestClient, fake_slurm: FakeBackend
) -> None:
    # The array's throttle holds only its own tasks: a retry sent at once ran beside max_parallel others.
    fast = {"max": 1, "backoff_s": 0.1, "on": ["node_failure"]}
    job = {"entrypoint": TRAIN, "backend": "slurm", "retries": fast}
    sweep = api.post(SWEEPS, json=sweep_body(grid={"lr": [1, 2, 3]}, job=job, max_parallel=2)).json()
    first, second, third = (trial["job_id"] for trial in sweep["trials"])
    wait_for(lambda: fake_slurm.submit_calls, what="the sweep's array")
    assert [sorted(call) for call in fake_slurm.submit_calls] == [[first, second, third]]
    for trial in (first, second):  # the third is the array's queued task: it counts too
        fake_slurm.set_status(trial, JobState.running)
        wait_state(api, trial, "running")
    wait_state(api, third, "pending")
    fake_slurm.set_status(first, JobState.failed, "node failure", exit_code=1, kind="node_failure")
    wait_state(api, first, "retrying")
    time.sleep(0.6)  # the backoff, then many dispatch intervals: two trials are under way, of at most 2
    assert len(fake_slurm.submit_calls) == 1
    assert api.get(f"{JOBS}/{first}").json()["state"] == "retrying"
    fake_slurm.finish(second, 0.5)
    wait_for(lambda: len(fake_slurm.submit_calls) == 2, what="the retry, once a trial ended")
    assert fake_slurm.submit_calls[1:] == [[first]]
    assert wait_state(api, first, "pending")["attempt"] == 2
    assert fake_slurm.specs[first].kwargs["lr"] == 1
