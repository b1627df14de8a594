"""POST /api/v1/jobs: what is accepted, and every kind of bad input the foundation issue names.

Each bad request must answer 4xx with a body that names the field and the problem, and leave the
ledger exactly as it was (no job row, no event) with no backend call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from service.app import create_app
from service.config import Settings
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job
from tests.fakes import FakeBackend
from tests.support import login_headers, runtime_of

JOBS = "/api/v1/jobs"
VALID: dict[str, Any] = {"name": "ddp", "entrypoint": "worker.tasks.seed:ddp_step"}


def ledger_counts(api: TestClient) -> tuple[int, int]:
    """(jobs, "accepted" events): the dispatcher may already have added a "submitted" event."""
    with Session(runtime_of(api).engine) as session:
        jobs = session.exec(select(func.count()).select_from(Job)).one()
        accepted = select(func.count()).select_from(JobEvent).where(JobEvent.reason == "accepted")
        events = session.exec(accepted).one()
    return int(jobs), int(events)


def problems(response: Any) -> list[tuple[list[Any], str]]:
    """(loc, msg) of every problem in a FastAPI-style error body."""
    return [(item.get("loc", []), item["msg"]) for item in response.json()["detail"]]


# ---------------------------------------------------------------- accepted


def test_a_valid_job_is_stored_queued_and_returned_at_once(api: TestClient) -> None:
    response = api.post(JOBS, json={**VALID, "kwargs": {"lr": 0.01}, "env": {"OMP_NUM_THREADS": "1"}})

    assert response.status_code == 201, response.text
    job = response.json()
    assert isinstance(job["id"], int) and job["id"] >= 1
    assert job["state"] == "queued"
    assert job["name"] == "ddp"
    assert job["backend"] == "local"  # the settings' default
    assert job["attempt"] == 1
    assert job["spec"]["entrypoint"] == "worker.tasks.seed:ddp_step"
    assert job["spec"]["kwargs"] == {"lr": 0.01}
    assert job["spec"]["env"] == {"OMP_NUM_THREADS": "1"}
    assert job["spec"]["resources"]["nodes"] == 1
    assert job["folder"].endswith(f"/jobs/{job['id']}")
    assert job["created_at"] and job["exit_code"] is None and job["result"] is None
    assert ledger_counts(api) == (1, 1)  # the job and its "accepted" event


def test_a_script_job_with_args_is_accepted(api: TestClient, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")

    response = api.post(JOBS, json={"name": "s", "script": str(script), "args": ["--epochs", "3"]})

    assert response.status_code == 201, response.text
    assert response.json()["spec"]["script"] == str(script)
    assert response.json()["spec"]["args"] == ["--epochs", "3"]


def test_a_multi_node_job_goes_to_slurm_when_asked(api: TestClient, fake_slurm: FakeBackend) -> None:
    response = api.post(JOBS, json={**VALID, "backend": "slurm", "resources": {"nodes": 2}})

    assert response.status_code == 201, response.text
    assert response.json()["backend"] == "slurm"
    assert fake_slurm.validate_calls == 1  # the backend checked it before it was queued


def test_the_maximum_tasks_per_node_is_allowed(api: TestClient, settings: Settings) -> None:
    resources = {"tasks_per_node": settings.max_tasks_per_node}
    assert api.post(JOBS, json={**VALID, "resources": resources}).status_code == 201


# ---------------------------------------------------------------- refused

# (description, body, status, expected loc, a fragment of the message)
BAD_BODIES: list[tuple[str, Any, int, list[Any], str]] = [
    ("unknown field", {**VALID, "colour": "red"}, 422, ["body", "colour"], "Extra inputs"),
    (
        "unknown resource",
        {**VALID, "resources": {"gpu": 1}},
        422,
        ["body", "resources", "gpu"],
        "Extra inputs",
    ),
    ("name missing", {"entrypoint": VALID["entrypoint"]}, 422, ["body", "name"], "required"),
    ("name wrong type", {**VALID, "name": 5}, 422, ["body", "name"], "valid string"),
    ("name empty", {**VALID, "name": ""}, 422, ["body", "name"], "at least 1 character"),
    (
        "nodes wrong type",
        {**VALID, "resources": {"nodes": "many"}},
        422,
        ["body", "resources", "nodes"],
        "valid integer",
    ),
    ("args not a list", {**VALID, "args": "--fast"}, 422, ["body", "args"], "valid list"),
    ("args of numbers", {**VALID, "args": [1]}, 422, ["body", "args", 0], "valid string"),
    ("env value a number", {**VALID, "env": {"A": 1}}, 422, ["body", "env", "A"], "valid string"),
    ("kwargs a list", {**VALID, "kwargs": [1, 2]}, 422, ["body", "kwargs"], "valid dictionary"),
    (
        "nodes below 1",
        {**VALID, "resources": {"nodes": 0}},
        422,
        ["body", "resources", "nodes"],
        "greater than or equal to 1",
    ),
    (
        "tasks_per_node below 1",
        {**VALID, "resources": {"tasks_per_node": 0}},
        422,
        ["body", "resources", "tasks_per_node"],
        "greater than or equal to 1",
    ),
    (
        "tasks_per_node above the configured maximum",
        {**VALID, "resources": {"tasks_per_node": 9}},
        422,
        ["body", "resources", "tasks_per_node"],
        "maximum of 8",
    ),
    (
        "nodes above the configured maximum",
        {**VALID, "backend": "slurm", "resources": {"nodes": 5}},
        422,
        ["body", "resources", "nodes"],
        "maximum of 4",
    ),
    (
        "gpus above the configured maximum",
        {**VALID, "resources": {"gpus_per_node": 3}},
        422,
        ["body", "resources", "gpus_per_node"],
        "maximum of 2",
    ),
    (
        "timeout of zero",
        {**VALID, "resources": {"timeout_min": 0}},
        422,
        ["body", "resources", "timeout_min"],
        "greater than or equal to 1",
    ),
    (
        "two nodes on the local backend",
        {**VALID, "resources": {"nodes": 2}},
        422,
        ["body", "resources", "nodes"],
        "local backend runs on one node",
    ),
    (
        "both entrypoint and script",
        {**VALID, "script": "/bin/true"},
        422,
        ["body"],
        "exactly one of 'entrypoint' or 'script'",
    ),
    (
        "neither entrypoint nor script",
        {"name": "x"},
        422,
        ["body"],
        "exactly one of 'entrypoint' or 'script'",
    ),
    (
        "entrypoint without a function",
        {**VALID, "entrypoint": "worker.tasks.seed"},
        422,
        ["body", "entrypoint"],
        "package.module:function",
    ),
    (
        "entrypoint with spaces",
        {**VALID, "entrypoint": "os:system; rm -rf /"},
        422,
        ["body", "entrypoint"],
        "package.module:function",
    ),
    (
        "entrypoint with two colons",
        {**VALID, "entrypoint": "a.b:c:d"},
        422,
        ["body", "entrypoint"],
        "package.module:function",
    ),
    (
        "entrypoint starting with a digit",
        {**VALID, "entrypoint": "1pkg.mod:f"},
        422,
        ["body", "entrypoint"],
        "package.module:function",
    ),
    (
        "entrypoint with a trailing newline",
        {**VALID, "entrypoint": "a.b:c\n"},
        422,
        ["body", "entrypoint"],
        "package.module:function",
    ),
    (
        "script outside the allowed folders",
        {"name": "s", "script": "/nonexistent/train.py"},
        403,
        ["body", "script"],
        "outside the folders scripts may run from",
    ),
    ("relative script", {"name": "s", "script": "train.py"}, 422, ["body", "script"], "absolute path"),
    ("script with ..", {"name": "s", "script": "/a/../b.py"}, 422, ["body", "script"], "'..'"),
    ("unknown backend", {**VALID, "backend": "kubernetes"}, 422, ["body", "backend"], "'local' or 'slurm'"),
    ("body is a list", [VALID], 422, ["body"], "valid dictionary"),
]


@pytest.mark.parametrize(
    ("body", "status", "loc", "message"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_BODIES],
)
def test_bad_input_is_refused_naming_the_field_and_writes_nothing(
    api: TestClient, fake: FakeBackend, body: Any, status: int, loc: list[Any], message: str
) -> None:
    response = api.post(JOBS, json=body)

    assert response.status_code == status, response.text
    found = problems(response)
    assert any(where == loc and message in msg for where, msg in found), found
    assert ledger_counts(api) == (0, 0)
    assert fake.submit_calls == []


def test_a_missing_script_or_a_folder_inside_an_allowed_folder_is_refused(
    api: TestClient, tmp_path: Path
) -> None:
    for script in (tmp_path / "missing.py", tmp_path):
        response = api.post(JOBS, json={"name": "s", "script": str(script)})

        assert response.status_code == 422, response.text
        assert problems(response) == [(["body", "script"], f"script: no such file: {script}")]
    assert ledger_counts(api) == (0, 0)


def test_a_body_that_is_not_json_is_refused(api: TestClient) -> None:
    response = api.post(JOBS, content=b"{not json", headers={"content-type": "application/json"})

    assert response.status_code == 422
    assert any("JSON" in msg for _, msg in problems(response))
    assert ledger_counts(api) == (0, 0)


@pytest.mark.parametrize(
    ("raw", "loc"),
    [
        pytest.param(
            '{"resources": {"mem_gb": Infinity}}', ["body", "resources", "mem_gb"], id="infinite mem"
        ),
        pytest.param('{"resources": {"mem_gb": NaN}}', ["body", "resources", "mem_gb"], id="nan mem"),
        pytest.param('{"kwargs": {"lr": NaN}}', ["body", "kwargs"], id="nan kwarg"),
        pytest.param('{"kwargs": {"lr": -Infinity}}', ["body", "kwargs"], id="infinite kwarg"),
    ],
)
def test_numbers_json_cannot_hold_are_refused(api: TestClient, raw: str, loc: list[Any]) -> None:
    """Python's JSON parser takes NaN and Infinity; the ledger (PostgreSQL JSON) cannot store them."""
    body = json.dumps(VALID)[:-1] + ", " + raw[1:]

    response = api.post(JOBS, content=body, headers={"content-type": "application/json"})

    assert response.status_code == 422, response.text
    assert any(where[: len(loc)] == loc and "finite" in msg for where, msg in problems(response))
    assert ledger_counts(api) == (0, 0)


@pytest.mark.parametrize(
    ("field", "value", "loc"),
    [
        ("name", "a\x00b", ["body", "name"]),
        ("entrypoint", "a.b:c\x00", ["body", "entrypoint"]),
        ("args", ["--x", "a\x00"], ["body", "args"]),
        ("env", {"A\x00": "1"}, ["body", "env"]),
    ],
)
def test_a_nul_character_is_refused(api: TestClient, field: str, value: Any, loc: list[Any]) -> None:
    """PostgreSQL text and process arguments cannot hold NUL: a 422 up front, not a failed commit (500)."""
    response = api.post(JOBS, json={**VALID, field: value})

    assert response.status_code == 422, response.text
    assert any(where == loc and ("NUL" in msg or "package" in msg) for where, msg in problems(response))
    assert ledger_counts(api) == (0, 0)


def test_a_script_path_with_nul_is_refused(api: TestClient) -> None:
    response = api.post(JOBS, json={"name": "s", "script": "/tmp/x\x00.py"})

    assert response.status_code == 422, response.text
    assert problems(response)[0][0] == ["body", "script"]
    assert ledger_counts(api) == (0, 0)


def test_a_bad_request_does_not_spoil_good_ones_beside_it(api: TestClient) -> None:
    """Group commit writes many jobs in one transaction: a bad one must never reach it."""
    bad = api.post(JOBS, json={**VALID, "name": "bad\x00"})
    good = api.post(JOBS, json=VALID)

    assert bad.status_code == 422
    assert good.status_code == 201
    with Session(runtime_of(api).engine) as session:  # the dispatcher may already have added an event
        names = session.exec(select(Job.name)).all()
        event_jobs = set(session.exec(select(JobEvent.job_id)).all())
    assert names == ["ddp"] and event_jobs == {good.json()["id"]}


def test_the_backend_can_refuse_a_request_it_could_never_run(
    api: TestClient, fake_slurm: FakeBackend
) -> None:
    fake_slurm.refuse_validation = "Requested node configuration is not available"

    response = api.post(JOBS, json={**VALID, "backend": "slurm", "resources": {"nodes": 3}})

    assert response.status_code == 422
    assert any("node configuration is not available" in msg for _, msg in problems(response))
    assert ledger_counts(api) == (0, 0)


def test_a_backend_this_service_does_not_run_is_refused(settings: Settings) -> None:
    app = create_app(settings, backends={"local": FakeBackend("local")})
    with TestClient(app) as api:
        response = api.post(JOBS, json={**VALID, "backend": "slurm"}, headers=login_headers(app))

        assert response.status_code == 422
        assert problems(response) == [
            (["body", "backend"], "backend: backend 'slurm' is not available on this service")
        ]
        assert ledger_counts(api) == (0, 0)
