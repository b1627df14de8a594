"""The rule of a waiting job (service.domain.dependencies.verdict): queued once every dependency
ended as its `on` asks, cancelled naming the first that ended otherwise, else waiting on."""

from __future__ import annotations

import pytest

from service.domain.dependencies import Upstream, verdict, waiting_reason
from service.states import JobState


def one(state: str, on: str = "succeeded", job_id: int = 7) -> Upstream:
    return Upstream(job_id=job_id, on=on, state=state, name="train")


@pytest.mark.parametrize(
    ("state", "on", "target"),
    [
        ("succeeded", "succeeded", JobState.queued),
        ("failed", "succeeded", JobState.cancelled),
        ("cancelled", "succeeded", JobState.cancelled),
        ("timeout", "succeeded", JobState.cancelled),
        ("failed", "failed", JobState.queued),
        ("timeout", "failed", JobState.queued),
        ("succeeded", "failed", JobState.cancelled),
        ("cancelled", "failed", JobState.cancelled),
        ("cancelled", "ended", JobState.queued),
        ("succeeded", "ended", JobState.queued),
        # Not ended yet, whatever `on` says: a retry is waited out.
        ("retrying", "succeeded", None),
        ("retrying", "ended", None),
        ("running", "failed", None),
        ("waiting", "ended", None),
    ],
)
def test_one_dependency(state: str, on: str, target: JobState | None) -> None:
    assert verdict([one(state, on)]).target is target


def test_a_dependency_that_cannot_be_met_cancels_even_while_others_run() -> None:
    decided = verdict([one("running", job_id=3), one("failed", job_id=4)])
    assert decided.target is JobState.cancelled
    assert decided.reason == "dependency job 4 (train) failed; this job needed it to succeed"


def test_all_must_be_met_to_go() -> None:
    assert verdict([one("succeeded", job_id=3), one("running", job_id=4)]).target is None
    going = verdict([one("succeeded", job_id=3), one("failed", "failed", job_id=4)])
    assert (
        going.target is JobState.queued and going.reason == "dependencies met: job 3 succeeded, job 4 failed"
    )


def test_the_waiting_reason_says_what_for() -> None:
    assert waiting_reason([(3, "succeeded"), (4, "ended")]) == "waiting for job 3 to succeed, job 4 to end"
