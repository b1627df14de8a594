"""What every rank is told of its run: the job, a run id that stays the same over attempts (what an
experiment tracker resumes), the attempt, and where the jobs it ran after are described."""

from __future__ import annotations

from worker.runner import identity_vars
from worker.spec import RunSpec, UpstreamJob


def spec(**fields: object) -> RunSpec:
    return RunSpec.model_validate(
        {"job_id": 12, "name": "train", "entrypoint": "a.b:c", "folder": "/j/12", **fields}
    )


def test_the_run_id_outlives_attempts() -> None:
    first = identity_vars(spec(attempt=1, run_id="torchyard-12-20261207T010203"))
    third = identity_vars(spec(attempt=3, run_id="torchyard-12-20261207T010203"))
    assert first["TORCHYARD_RUN_ID"] == third["TORCHYARD_RUN_ID"] == "torchyard-12-20261207T010203"
    assert (first["TORCHYARD_ATTEMPT"], third["TORCHYARD_ATTEMPT"]) == ("1", "3")
    assert first["TORCHYARD_JOB_ID"] == "12" and "TORCHYARD_UPSTREAM" not in first


def test_a_run_id_is_named_even_for_a_spec_without_one() -> None:
    assert identity_vars(spec())["TORCHYARD_RUN_ID"] == "job-12"


def test_a_dependent_is_told_where_its_upstream_is() -> None:
    upstream = [UpstreamJob(job_id=11, name="prepare", state="succeeded", result={"rows": 8})]
    assert identity_vars(spec(upstream=upstream))["TORCHYARD_UPSTREAM"] == "/j/12/upstream.json"
