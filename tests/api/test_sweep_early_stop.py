"""A sweep's early_stop over the API: the 422s that name its fields, and the reconcile loop's pruning
pass deciding from the ledger's metrics (the fake backend: the rule's own tests are in
tests/unit/service/test_sweep_pruning.py, real processes in tests/integration/test_sweep_pruning_local.py)."""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient
from rich.console import Console

from service.cli.sweep_view import sweep_view
from service.cli.sweeps import all_done
from tests.api.test_sweeps import SWEEPS, stored_counts
from tests.fakes import FakeBackend
from tests.support import get_job, wait_for

LRS = [0.1, 0.01, 0.3, 0.004, 0.05, 1.0, 0.0003, 0.02, 0.6]  # loss floor |log10(lr / 0.01)|
EARLY = {"method": "asha", "min_steps": 10, "reduction_factor": 3, "max_steps": 90}


def body(**early: Any) -> dict[str, Any]:
    return {
        "name": "curves",
        "job": {"entrypoint": "worker.tasks.curves:curve", "kwargs": {"steps": 90}},
        "grid": {"lr": LRS},
        "early_stop": {**EARLY, **early},
    }


@pytest.mark.parametrize(
    ("early", "loc"),
    [
        ({"reduction_factor": 1}, ["body", "early_stop", "reduction_factor"]),
        ({"reduction_factor": "3x"}, ["body", "early_stop", "reduction_factor"]),
        ({"min_steps": 0}, ["body", "early_stop", "min_steps"]),
        ({"method": "tpe"}, ["body", "early_stop", "method"]),
        ({"max_steps": 10}, ["body", "early_stop", "max_steps"]),  # no rung below it
        ({"rungs": 3}, ["body", "early_stop", "rungs"]),
    ],
)
def test_bad_early_stop_names_the_field_and_stores_nothing(
    api: TestClient, early: dict[str, Any], loc: list[str]
) -> None:
    response = api.post(SWEEPS, json=body(**early))
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][: len(loc)] == loc
    assert stored_counts(api) == (0, 0)


def test_losing_trials_are_stopped_as_pruned_and_the_sweep_says_what_was_saved(
    api: TestClient, fake: FakeBackend
) -> None:
    sweep = api.post(SWEEPS, json=body()).json()
    assert sweep["early_stop"] == EARLY
    ids = [trial["job_id"] for trial in sweep["trials"]]
    wait_for(
        lambda: all(api.get(f"/api/v1/jobs/{i}").json()["state"] == "running" for i in ids), 10, "running"
    )
    for job_id, lr in zip(ids, LRS, strict=True):  # every trial reports its first 10 steps, in order
        spec = fake.specs[job_id]
        lines = [
            {"step": step, "total": 90, "metrics": {"loss": abs(math.log10(lr / 0.01)) + 1 / step},
             "time": time.time(), "attempt": spec.attempt}
            for step in range(1, 11)
        ]  # fmt: skip
        spec.files.progress.write_text("".join(json.dumps(line) + "\n" for line in lines))
        wait_for(lambda job_id=job_id: get_job(api, job_id)["progress"], 10, "its reports read")
    stopped = [ids[index] for index in (2, 3, 4, 5, 6, 8)]  # as the rule's unit test has it

    def pruned() -> dict[str, Any] | None:
        read: dict[str, Any] = api.get(f"{SWEEPS}/{sweep['id']}").json()
        return read if read["counts"].get("cancelled") == len(stopped) else None

    read = wait_for(pruned, 10, "the losers pruned")
    by_id = {trial["job_id"]: trial for trial in read["trials"]}
    for job_id in ids:
        trial = by_id[job_id]
        if job_id in stopped:
            assert (trial["state"], trial["ending"]) == ("cancelled", "pruned")
            assert trial["reason"].startswith("pruned at rung 0 (step 10): loss "), trial["reason"]
            assert ", the cut " in trial["reason"]
        else:
            assert (trial["state"], trial["ending"]) == ("running", None)
        assert trial["steps"] == 10
    assert sorted(e for call in fake.cancel_calls for e in call) == sorted(
        fake.external_id(i) for i in stopped
    )
    assert read["compute"] == {"steps_run": 90, "steps_full": 810, "saved": round(1 - 90 / 810, 4)}
    attempts = api.get(f"/api/v1/jobs/{stopped[0]}/attempts").json()  # the attempt's row says why it ended
    assert [attempt["kind"] for attempt in attempts] == ["pruned"]
    shown = shown_by_the_cli(read)
    assert "early stop: asha, rungs from 10 steps x3; 90 of 810 steps run (89% saved)" in shown, shown
    assert shown.count("cancelled (pruned)") == len(stopped) and "STEPS" in shown, shown


def shown_by_the_cli(sweep: dict[str, Any]) -> str:
    """What `torchyard sweep show` prints for this sweep's JSON."""
    console = Console(record=True, width=200, color_system=None)
    console.print(sweep_view(sweep))
    return console.export_text()


def test_sweep_wait_counts_a_pruned_trial_as_done() -> None:
    """`torchyard sweep FILE --wait` exits 0 when each trial succeeded or early_stop stopped it."""
    ok, pruned = {"state": "succeeded"}, {"state": "cancelled", "ending": "pruned"}
    assert all_done({"trials": [ok, pruned, pruned]})
    assert not all_done({"trials": [ok, {"state": "cancelled", "ending": "cancel"}]})
    assert not all_done({"trials": [ok, {"state": "failed", "ending": "failure"}]})
    assert all_done({"counts": {"succeeded": 2}}) and not all_done({"counts": {"cancelled": 1}})
