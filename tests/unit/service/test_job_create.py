"""JobCreate, the body of POST /api/v1/jobs: what it accepts, its defaults, and what it refuses."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import ValidationError

from service.ledger.models.jobs import JobCreate

BASE: dict[str, Any] = {"name": "train", "entrypoint": "worker.tasks.train:main"}


def refused(body: dict[str, Any]) -> list[tuple[tuple[int | str, ...], str]]:
    with pytest.raises(ValidationError) as caught:
        JobCreate.model_validate(body)
    return [(error["loc"], error["msg"]) for error in caught.value.errors()]


def test_a_minimal_job_gets_the_defaults() -> None:
    job = JobCreate.model_validate(BASE)

    assert job.script is None and job.args == [] and job.kwargs == {} and job.env == {}
    assert job.backend is None  # the service's default decides
    res = job.resources
    assert (res.nodes, res.tasks_per_node, res.cpus_per_task, res.gpus_per_node) == (1, 1, 1, 0)
    assert res.mem_gb is None and res.timeout_min == 60 and res.partition is None
    assert res.world_size == 1


def test_a_full_script_job() -> None:
    body = {
        "name": "s",
        "script": "/opt/train.py",
        "args": ["--lr", "0.1"],
        "env": {"OMP_NUM_THREADS": "2"},
        "backend": "slurm",
        "resources": {"nodes": 2, "tasks_per_node": 4, "gpus_per_node": 4, "mem_gb": 64, "partition": "gpu"},
    }

    job = JobCreate.model_validate(body)

    assert job.script == "/opt/train.py" and job.args == ["--lr", "0.1"]
    assert job.resources.world_size == 8 and job.resources.partition == "gpu"


@pytest.mark.parametrize(
    "entrypoint",
    ["pkg:f", "pkg.mod:main", "a.b.c_d:_run", "Worker2.tasks:Train"],
)
def test_well_formed_entrypoints(entrypoint: str) -> None:
    assert JobCreate.model_validate({**BASE, "entrypoint": entrypoint}).entrypoint == entrypoint


@pytest.mark.parametrize(
    "entrypoint",
    [
        "pkg",
        "pkg.mod",
        ":f",
        "pkg:",
        "pkg:f:g",
        "pkg..mod:f",
        "1pkg:f",
        "pkg:f()",
        "pkg mod:f",
        "pkg:f\n",
        "a-b:c",
    ],
)
def test_malformed_entrypoints(entrypoint: str) -> None:
    assert refused({**BASE, "entrypoint": entrypoint}) == [
        (("entrypoint",), "Value error, must look like 'package.module:function'")
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"name": "x"},
        {"name": "x", "entrypoint": "a:b", "script": "/t.py"},
        {"name": "x", "entrypoint": None, "script": None},
    ],
)
def test_exactly_one_of_entrypoint_and_script(body: dict[str, Any]) -> None:
    assert refused(body) == [((), "Value error, give exactly one of 'entrypoint' or 'script'")]


@pytest.mark.parametrize(
    ("resources", "field", "message"),
    [
        ({"nodes": 0}, "nodes", "greater than or equal to 1"),
        ({"nodes": -1}, "nodes", "greater than or equal to 1"),
        ({"tasks_per_node": 0}, "tasks_per_node", "greater than or equal to 1"),
        ({"cpus_per_task": 0}, "cpus_per_task", "greater than or equal to 1"),
        ({"gpus_per_node": -1}, "gpus_per_node", "greater than or equal to 0"),
        ({"mem_gb": 0}, "mem_gb", "greater than 0"),
        ({"mem_gb": math.inf}, "mem_gb", "finite number"),
        ({"mem_gb": math.nan}, "mem_gb", "finite number"),
        ({"timeout_min": 0}, "timeout_min", "greater than or equal to 1"),
        ({"timeout_min": 60 * 24 * 31}, "timeout_min", "less than or equal to"),
        ({"nodes": 1.5}, "nodes", "valid integer"),
        ({"nodes": "two"}, "nodes", "valid integer"),
        ({"partition": "gpu; rm -rf /"}, "partition", "pattern"),
        ({"gpus": 1}, "gpus", "Extra inputs"),
    ],
)
def test_resource_bounds(resources: dict[str, Any], field: str, message: str) -> None:
    [(loc, msg)] = refused({**BASE, "resources": resources})
    assert loc == ("resources", field) and message in msg


@pytest.mark.parametrize(
    ("extra", "loc", "message"),
    [
        ({"colour": "red"}, ("colour",), "Extra inputs"),
        ({"name": ""}, ("name",), "at least 1 character"),
        ({"name": "x" * 201}, ("name",), "at most 200 characters"),
        ({"name": "a\x00"}, ("name",), "NUL"),
        ({"backend": "k8s"}, ("backend",), "'local' or 'slurm'"),
        ({"args": "--fast"}, ("args",), "valid list"),
        ({"args": ["ok", "\x00"]}, ("args",), "NUL"),
        ({"env": {"A": 1}}, ("env", "A"), "valid string"),
        ({"env": {"A": "x\x00"}}, ("env",), "NUL"),
        ({"kwargs": {"lr": math.nan}}, ("kwargs",), "kwargs.lr must be a finite number"),
        ({"kwargs": {"sched": [{"lr": math.inf}]}}, ("kwargs",), "kwargs.sched.0.lr must be a finite number"),
        # What parses but no response, PostgreSQL or process can hold: the path names where it is.
        ({"kwargs": {"note": "\ud800"}}, ("kwargs",), "kwargs.note must not hold a lone UTF-16 surrogate"),
        ({"kwargs": {"tag": "a\x00b"}}, ("kwargs",), "kwargs.tag must not hold a NUL character"),
        ({"kwargs": {"\udfff": 1}}, ("kwargs",), "its name must not hold a lone UTF-16 surrogate"),
        ({"name": "\ud800"}, ("name",), "valid string"),  # pydantic refuses it in a plain str field
        ({"args": ["\ud800"]}, ("args",), "args.0 must not hold a lone UTF-16 surrogate"),
        ({"env": {"OMP_NUM_THREADS": "\ud800"}}, ("env",), "env.OMP_NUM_THREADS must not hold a lone"),
    ],
)
def test_field_errors_name_the_field(extra: dict[str, Any], loc: tuple[str, ...], message: str) -> None:
    [(where, msg)] = refused({**BASE, **extra})
    assert where == loc and message in msg


def test_kwargs_nested_too_deep_or_too_large_are_refused() -> None:
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(500):  # the depth that raised RecursionError (a 500) in the old finite-number check
        inner["a"] = {}
        inner = inner["a"]
    [(where, msg)] = refused({**BASE, "kwargs": deep})
    assert where == ("kwargs",) and "nests deeper than 32 levels" in msg
    [(where, msg)] = refused({**BASE, "kwargs": {"blob": "x" * (256 * 1024)}})
    assert where == () and "bytes of JSON together" in msg


def test_kwargs_keep_any_json() -> None:
    kwargs = {"lr": 0.1, "layers": [64, 32], "opt": {"name": "sgd", "momentum": None}, "tag": "\u00e9t\u00e9"}
    assert JobCreate.model_validate({**BASE, "kwargs": kwargs}).kwargs == kwargs
