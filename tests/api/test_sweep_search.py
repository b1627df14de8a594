"""A sweep's search over the API (the fake backend): the 422s that name its fields, and the reconcile
loop's search pass making trials as earlier ones end, never more than max_parallel unfinished at once
(the samplers' own tests: tests/unit/service/test_sweep_search.py)."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, col, select

from service.ledger.models.jobs import Job
from service.ledger.models.sweeps import Sweep
from service.states import TERMINAL_STATE_NAMES
from tests.api.test_sweeps import SWEEPS, stored_counts
from tests.fakes import FakeBackend
from tests.support import get_job, runtime_of, wait_for

SPACE = {
    "lr": {"log_uniform": [1e-5, 1e-1]},
    "dropout": {"uniform": [0, 0.5]},
    "layers": {"int": [1, 4]},
    "opt": {"choice": ["sgd", "adam"]},
}


def body(**search: Any) -> dict[str, Any]:
    return {
        "name": "tpe",
        "job": {"entrypoint": "worker.tasks.curves:curve", "kwargs": {"steps": 5}},
        "max_parallel": 2,
        "search": {"method": "tpe", "trials": 7, "seed": 3, "space": SPACE, **search},
    }


@pytest.mark.parametrize(
    ("changes", "loc"),
    [
        ({"search": {"method": "tpe", "trials": 4, "space": {"lr": {"log_uniform": [0, 1]}}}},
         ["body", "search", "space", "lr"]),
        ({"search": {"method": "tpe", "trials": 4, "space": {"opt": {"choice": []}}}},
         ["body", "search", "space", "opt"]),
        ({"search": {"method": "tpe", "trials": 0, "space": SPACE}}, ["body", "search", "trials"]),
        ({"search": {"method": "tpe", "trials": 10**6, "space": SPACE}}, ["body", "search", "trials"]),
        ({"search": {"method": "grid", "trials": 4, "space": SPACE}}, ["body", "search", "method"]),
        ({"grid": {"lr": [0.1]}}, ["body", "search"]),
        ({"max_parallel": None}, ["body", "max_parallel"]),  # tpe would learn nothing
        ({"job": {"entrypoint": "worker.tasks.curves:curve", "kwargs": {"lr": 0.1}}},
         ["body", "search", "space", "lr"]),
    ],
)  # fmt: skip
def test_bad_search_names_the_field_and_stores_nothing(
    api: TestClient, changes: dict[str, Any], loc: list[str]
) -> None:
    response = api.post(SWEEPS, json={**body(), **changes})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][: len(loc)] == loc
    assert stored_counts(api) == (0, 0)


def unfinished_in_ledger(api: TestClient, sweep_id: int) -> int:
    with Session(runtime_of(api).engine) as session:
        states = session.exec(select(col(Job.state)).where(col(Job.sweep_id) == sweep_id)).all()
    return sum(1 for state in states if state not in TERMINAL_STATE_NAMES)


def test_trials_are_made_as_earlier_ones_end_never_more_than_max_parallel(
    api: TestClient, fake: FakeBackend
) -> None:
    made = api.post(SWEEPS, json=body())
    assert made.status_code == 201, made.text
    sweep = made.json()
    assert sweep["size"] == 2 and len(sweep["trials"]) == 2  # the first wave: max_parallel of 7
    assert sweep["search"]["seed"] == 3 and sweep["state"] == "active"
    sweep_id = sweep["id"]
    finished: set[int] = set()
    most = 0
    deadline = time.monotonic() + 60
    while len(finished) < 7:
        assert time.monotonic() < deadline, f"finished {sorted(finished)}"
        read = api.get(f"{SWEEPS}/{sweep_id}").json()
        unfinished = [trial for trial in read["trials"] if trial["state"] not in TERMINAL_STATE_NAMES]
        most = max(most, len(unfinished), unfinished_in_ledger(api, sweep_id))
        for trial in read["trials"]:
            job_id = trial["job_id"]
            if job_id in finished or get_job(api, job_id)["state"] != "running":
                continue
            params = trial["params"]
            loss = abs(params["layers"] - 3) + params["dropout"]  # the metric TPE learns from
            spec = fake.specs[job_id]
            line = {"step": 5, "total": 5, "metrics": {"loss": loss}, "time": time.time(),
                    "attempt": spec.attempt}  # fmt: skip
            spec.files.progress.write_text(json.dumps(line) + "\n")
            wait_for(lambda job_id=job_id: get_job(api, job_id)["progress"], 10, "its report read")
            fake.finish(job_id, loss)
            finished.add(job_id)
        time.sleep(0.02)
    read = wait_for(
        lambda: (r := api.get(f"{SWEEPS}/{sweep_id}").json())["state"] == "finished" and r, 20, "all ended"
    )
    assert most <= 2
    assert read["size"] == 7 and len(read["trials"]) == 7
    assert [trial["name"] for trial in read["trials"]] == [f"tpe[{index}]" for index in range(7)]
    assert read["counts"] == {"succeeded": 7}
    assert read["best"]["metric_last"] == min(trial["metric_last"] for trial in read["trials"])
    for trial in read["trials"]:
        params = trial["params"]
        assert 1e-5 <= params["lr"] <= 1e-1 and 0 <= params["dropout"] <= 0.5
        assert params["layers"] in (1, 2, 3, 4) and params["opt"] in ("sgd", "adam")
        assert get_job(api, trial["job_id"])["spec"]["kwargs"] == {"steps": 5, **params}
    with Session(runtime_of(api).engine) as session:
        stored = session.get(Sweep, sweep_id)
        assert stored is not None and stored.size == stored.search_trials == 7


def test_a_search_is_no_pipeline_stage_yet(api: TestClient) -> None:
    """A stage ends when its jobs have: a search's jobs are made later, so a stage cannot be one yet."""
    search = {"job": {"entrypoint": "worker.tasks.curves:curve"}, "max_parallel": 2,
              "search": {"method": "random", "trials": 4, "space": SPACE}}  # fmt: skip
    response = api.post("/api/v1/pipelines", json={"name": "p", "stages": [{"name": "s", "sweep": search}]})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "stages", "0", "sweep", "search"]
    assert stored_counts(api) == (0, 0)
