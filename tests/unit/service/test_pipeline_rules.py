"""The pure rules of pipelines: the stage graph (checked, ordered, what a retry reruns) and the state a
pipeline is in from its stages'."""

from __future__ import annotations

from typing import Any

import pytest

from service.domain.endings import PRUNED
from service.domain.pipeline_graph import check_stages, downstream
from service.domain.pipeline_state import (
    ACTIVE,
    CANCELLED_BY_USER,
    StageOutcome,
    pipeline_outcome,
    stage_outcome,
)
from service.errors import InvalidRequest
from service.ledger.models.pipelines import StageCreate

JOB = {"entrypoint": "worker.tasks.seed:ddp_step"}


def stages(*specs: tuple[str, list[str]]) -> list[StageCreate]:
    return [StageCreate(name=name, job=JOB, after=after) for name, after in specs]


def test_the_order_puts_every_stage_after_those_it_names() -> None:
    assert check_stages(stages(("a", []), ("b", ["a"]), ("c", ["b"]))) == [0, 1, 2]
    assert check_stages(stages(("evaluate", ["train"]), ("train", ["prepare"]), ("prepare", []))) == [2, 1, 0]
    assert check_stages(stages(("x", []), ("y", []), ("z", ["x", "y"]))) == [0, 1, 2]


@pytest.mark.parametrize(
    ("specs", "field"),
    [
        ((("a", []), ("a", [])), "stages.1.name"),
        ((("a", ["a"]),), "stages.0.after.0"),
        ((("a", []), ("b", ["a", "nope"])), "stages.1.after.1"),
        ((("a", []), ("b", ["a", "a"])), "stages.1.after.1"),
        ((("a", ["c"]), ("b", ["a"]), ("c", ["b"])), "stages.0.after.0"),
    ],
)
def test_a_graph_that_cannot_run_is_refused_naming_the_field(
    specs: tuple[tuple[str, list[str]], ...], field: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_stages(stages(*specs))
    assert refused.value.field == field


def test_a_stage_is_a_job_or_a_sweep() -> None:
    for body in ({}, {"job": JOB, "sweep": {"job": JOB}}):
        with pytest.raises(InvalidRequest) as refused:
            check_stages([StageCreate(name="a", **body)])
        assert refused.value.field == "stages.0"


def test_a_retry_reruns_the_stage_and_all_downstream_of_it() -> None:
    after: dict[str, list[str]] = {"prepare": [], "train": ["prepare"], "evaluate": ["train"],
                                   "report": ["evaluate", "prepare"], "side": ["prepare"]}  # fmt: skip
    assert downstream(after, "train") == {"train", "evaluate", "report"}
    assert downstream(after, "prepare") == set(after)
    assert downstream(after, "report") == {"report"}


def outcome(name: str, state: str, reason: str | None = None) -> StageOutcome:
    return StageOutcome(name, state, reason)


def test_the_pipeline_state_follows_its_stages() -> None:
    ok = outcome("prepare", "succeeded")
    assert pipeline_outcome([ok, outcome("train", "running")]) == ("running", None)
    assert pipeline_outcome([ok, outcome("train", "succeeded")]) == ("succeeded", None)
    failed = [ok, outcome("train", "failed", "exit 1"),
              outcome("evaluate", "cancelled", "dependency job 2 (train) failed; ...")]  # fmt: skip
    assert pipeline_outcome(failed) == ("failed", "stage 'train' failed: exit 1")
    # the first stage to fail on its own is named, not the ones cancelled because of it
    assert pipeline_outcome(list(reversed(failed)))[1] == "stage 'train' failed: exit 1"
    cancelled = [ok, outcome("train", "cancelled", CANCELLED_BY_USER), outcome("evaluate", "cancelled",
                 CANCELLED_BY_USER)]  # fmt: skip
    assert pipeline_outcome(cancelled) == ("cancelled", CANCELLED_BY_USER)


def test_a_sweep_stage_is_active_until_every_trial_ended() -> None:
    trials: list[Any] = [("succeeded", None), ("running", None)]
    assert stage_outcome("s", trials, sweep=True).state == ACTIVE
    assert stage_outcome("s", [("succeeded", None)] * 2, sweep=True).state == "succeeded"
    assert stage_outcome("s", [("succeeded", None), ("failed", "boom")], sweep=True) == StageOutcome(
        "s", "failed", "boom"
    )
    assert stage_outcome("j", [("queued", None)]).state == "queued"


def test_a_sweep_stage_whose_early_stop_stopped_trials_succeeds() -> None:
    """A trial early_stop stopped ended as the sweep meant it to; a user's cancel still counts."""
    pruned = ("cancelled", f"{PRUNED}0 (step 10): loss 1.1, the cut 0.2")
    assert stage_outcome("s", [("succeeded", None), pruned, pruned], sweep=True).state == "succeeded"
    by_user = ("cancelled", CANCELLED_BY_USER)
    stage = stage_outcome("s", [("succeeded", None), pruned, by_user], sweep=True)
    assert stage == StageOutcome("s", "cancelled", CANCELLED_BY_USER)
