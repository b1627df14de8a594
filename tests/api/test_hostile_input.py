"""Hostile input gets a clear 4xx and stores nothing; hostile job output cannot break a reader (issue 15).

Each of these was a 500, and the first one also broke every later list: the job was committed, and
its row could not be rendered for its owner or for the admin.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import login_headers, wait_for

JOBS = "/api/v1/jobs"
VALID: dict[str, Any] = {"name": "ok", "entrypoint": "worker.tasks.seed:ddp_step"}


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


def post_raw(api: TestClient, body: str) -> Any:
    return api.post(JOBS, content=body.encode(), headers={"content-type": "application/json"})


def every_list_reads(api: TestClient) -> None:
    admin = login_headers(api.app, "root", admin=True)
    for headers in ({}, admin):
        listed = api.get(JOBS, headers=headers)
        assert listed.status_code == 200, listed.text
        for item in listed.json()["items"]:
            assert api.get(f"{JOBS}/{item['id']}", headers=headers).status_code == 200


# (what a hostile client sends, merged into a valid spec; where the 422 points; what its message says)
REFUSED = {
    "surrogate kwarg": ('{"kwargs": {"note": "\\ud800"}}', ["body", "kwargs"], "kwargs.note"),
    "nul kwarg name": ('{"kwargs": {"n\\u0000": 1}}', ["body", "kwargs"], "NUL"),
    "surrogate name": ('{"name": "\\ud800"}', ["body", "name"], "string"),
    "deep": (json.dumps({"kwargs": nested(500)}), ["body", "kwargs"], "deeper"),
    "huge mem": ('{"resources": {"mem_gb": 1e308}}', ["body", "resources", "mem_gb"], "less than"),
    "huge cpus": ('{"resources": {"cpus_per_task": 100000}}', ["body", "resources", "cpus_per_task"], "less"),
}


@pytest.mark.parametrize(("body", "where", "says"), list(REFUSED.values()), ids=list(REFUSED))
def test_refused_with_the_field_named_and_nothing_stored(
    api: TestClient, fake: FakeBackend, body: str, where: list[str], says: str
) -> None:
    api.post(JOBS, json=VALID).raise_for_status()  # one good job the lists must keep showing
    raw = json.dumps(VALID)[:-1] + ", " + body[1:]
    response = post_raw(api, raw)
    assert response.status_code == 422, response.text
    problems = response.json()["detail"]
    assert any(p["loc"][: len(where)] == where and says in p["msg"] for p in problems), problems
    assert len(api.get(JOBS).json()["items"]) == 1
    every_list_reads(api)


def test_a_job_whose_result_no_json_can_hold_is_stored_cleaned(api: TestClient, fake: FakeBackend) -> None:
    job = api.post(JOBS, json=VALID).raise_for_status().json()
    wait_for(lambda: job["id"] in fake.specs, 10, "the job handed to the backend")
    spec = fake.specs[job["id"]]
    # What a hostile (or careless) rank 0 can write: NaN, a lone surrogate, NUL, and deep nesting.
    spec.files.result.write_text(
        '{"attempt": 1, "value": {"loss": NaN, "tag": "x\\ud800\\u0000y", "deep": '
        + json.dumps(nested(100))
        + "}}"
    )
    fake.set_status(job["id"], JobState.succeeded, "completed", 0)

    done = wait_for(lambda: (one := api.get(f"{JOBS}/{job['id']}").json())["result"] and one, 10, "result")
    assert done["result"]["loss"] is None and done["result"]["tag"] == "x\ufffdy"
    every_list_reads(api)
