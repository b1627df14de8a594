"""service.domain.sweep_trials: what a sweep's trials hold is counted before any trial is made."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.config import Settings
from service.domain.sweep_trials import check_sweep, trial_jobs, trial_params, trials_bytes
from service.errors import InvalidRequest
from service.ledger.models.sweeps import SweepCreate

TRAIN = "worker.tasks.train:train"


def sweep(job: dict[str, Any], **changes: Any) -> SweepCreate:
    return SweepCreate.model_validate({"name": "s", "job": job, **changes})


def held(made: SweepCreate) -> int:
    """What the trials really hold: their kwargs, args and env as JSON, made one by one."""
    jobs = trial_jobs(made, trial_params(made))
    return sum(len(json.dumps([job.kwargs, job.args, job.env])) for job in jobs)


@pytest.mark.parametrize(
    ("job", "grid", "zip_"),
    [
        ({"entrypoint": TRAIN, "kwargs": {"blob": "x" * 3000}}, {"lr": [0.1, 0.2], "seed": [1, 2, 3]}, {}),
        (
            {"entrypoint": TRAIN},
            {"big": ["x" * 4000, "y"], "seed": [1, 2, 3, 4]},
            {"a": [1, 2], "b": ["p", "q"]},
        ),
        (
            {"script": "/s.py", "args": ["--v={big}", "--w={big}", "{seed}"]},
            {"big": ["x" * 4000], "seed": [1, 2]},
            {},
        ),
    ],
)
def test_the_count_is_what_the_trials_hold(
    job: dict[str, Any], grid: dict[str, Any], zip_: dict[str, Any]
) -> None:
    made = sweep(job, grid=grid, zip=zip_)
    count = len(trial_params(made))
    # Apart from the few bytes each parameter's name and separators add to a trial's kwargs.
    assert abs(held(made) - trials_bytes(made, count)) <= count * 16 * (len(grid) + len(zip_))


def test_a_sweep_past_the_limit_is_refused_naming_where_its_bytes_are() -> None:
    settings = Settings(max_sweep_bytes=10_000)
    blob = {"entrypoint": TRAIN, "kwargs": {"blob": "x" * 3000}}
    check_sweep(sweep(blob, grid={"seed": [1, 2, 3]}), settings)
    with pytest.raises(InvalidRequest) as refused:
        check_sweep(sweep(blob, grid={"seed": [1, 2, 3, 4]}), settings)
    assert refused.value.field == "job.kwargs" and "4 trials" in refused.value.message
    script = {"script": "/s.py", "args": ["--big={big}"]}
    with pytest.raises(InvalidRequest) as refused:
        check_sweep(sweep(script, grid={"big": ["x" * 3000] * 4}), settings)
    assert refused.value.field == "job.args"


def test_the_trial_limit_names_zip_when_the_grid_is_empty() -> None:
    settings = Settings(max_sweep_trials=3)
    with pytest.raises(InvalidRequest) as refused:
        check_sweep(sweep({"entrypoint": TRAIN}, zip={"lr": [1, 2, 3, 4]}), settings)
    assert refused.value.field == "zip"
    with pytest.raises(InvalidRequest) as refused:
        check_sweep(sweep({"entrypoint": TRAIN}, grid={"a": [1, 2]}, zip={"lr": [1, 2]}), settings)
    assert refused.value.field == "grid"


def test_a_script_arg_keeps_literal_braces_written_twice() -> None:
    made = sweep(
        {"script": "/s.py", "args": ['--cfg={{"depth": {depth}}}', "--out=run_{{}}.txt", "{{lr}}={lr}"]},
        grid={"depth": [2], "lr": [0.1]},
    )
    check_sweep(made, Settings())

    [job] = trial_jobs(made, trial_params(made))

    assert job.args == ['--cfg={"depth": 2}', "--out=run_{}.txt", "{lr}=0.1"]


def test_a_lone_brace_pair_is_refused_with_how_to_write_one() -> None:
    made = sweep({"script": "/s.py", "args": ["--lr={lr}", "--out=run_{}.txt"]}, grid={"lr": [0.1]})
    with pytest.raises(InvalidRequest, match="names no parameter") as refused:
        check_sweep(made, Settings())
    assert refused.value.field == "job.args.1" and "'{{'" in refused.value.message
