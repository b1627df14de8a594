"""The same failure gets the same reason, whichever of the rank's error file and the scheduler's word
the reconciler sees first (issue 43, finding 10).

A rank writes its error file before it exits, but the scheduler can say FAILED before the file is
visible to the service (a shared file system shows a node's files late). Decided on the scheduler's
word alone, that job read "NonZeroExitCode" where the same failure, seen a tick later, read the rank's
ValueError. The reconciler now looks again for a short grace (TORCHYARD_ENDING_FILES_GRACE_S) before
it ends an attempt that nothing in its folder explains yet.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.loops.files_grace import FilesGrace
from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import authorize, get_job, runtime_of, submit, wait_state

TRACEBACK = 'attempt: 1\nTraceback (most recent call last):\n  File "train.py"\nValueError: diverged\n'


@pytest.fixture
def quiet_api(settings: Settings, fake: FakeBackend) -> Iterator[TestClient]:
    """The service with a reconcile loop that never ticks on its own (the test drives each tick), and
    a grace no test outlasts."""
    fake.poll_interval_s = 3600.0
    settings = settings.model_copy(update={"ending_files_grace_s": 3600.0})
    with TestClient(create_app(settings, backends={"local": fake})) as client:
        fake.set_wakeup(lambda: None)  # a scripted status wakes no tick of the loop's own
        yield authorize(client)


def started(api: TestClient, fake: FakeBackend) -> int:
    job_id: int = submit(api)["id"]
    wait_state(api, job_id, "submitted")
    runtime_of(api).reconciler.reconcile_once("local")
    assert get_job(api, job_id)["state"] == "running"
    return job_id


def tick(api: TestClient) -> None:
    runtime_of(api).reconciler.reconcile_once("local")


def test_the_scheduler_saying_failed_before_the_error_file_appears_gives_the_file_s_reason(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    api = quiet_api
    file_first, word_first = started(api, fake), started(api, fake)

    # One job as the tick usually sees it: the rank's file is there when the scheduler says FAILED.
    fake.specs[file_first].files.error(0).write_text(TRACEBACK)
    fake.set_status(file_first, JobState.failed, "NonZeroExitCode", exit_code=1)
    # The other: the scheduler's word first, the file one tick later.
    fake.set_status(word_first, JobState.failed, "NonZeroExitCode", exit_code=1)
    tick(api)
    assert get_job(api, word_first)["state"] == "running", "ended before its rank's file could show"
    fake.specs[word_first].files.error(0).write_text(TRACEBACK)
    tick(api)

    ends = [get_job(api, job_id) for job_id in (file_first, word_first)]
    assert [(job["state"], job["reason"], job["exit_code"]) for job in ends] == [
        ("failed", "rank 0 raised:\n" + TRACEBACK.split("\n", 1)[1].strip(), 1)
    ] * 2, ends


def test_without_a_file_the_scheduler_s_word_ends_the_job_once_the_grace_is_over(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    api = quiet_api
    job_id = started(api, fake)
    fake.set_status(job_id, JobState.failed, "NonZeroExitCode", exit_code=3)
    tick(api)
    assert get_job(api, job_id)["state"] == "running"

    runtime_of(api).reconciler.files_grace = FilesGrace(0.0)  # the grace is over
    tick(api)

    job = get_job(api, job_id)
    assert (job["state"], job["reason"], job["exit_code"]) == ("failed", "NonZeroExitCode", 3)


def test_a_cancel_or_a_scheduler_named_ending_does_not_wait(quiet_api: TestClient, fake: FakeBackend) -> None:
    api = quiet_api
    lost, out_of_time, cancelled = started(api, fake), started(api, fake), started(api, fake)
    fake.set_status(lost, JobState.failed, "NODE_FAIL", kind="node_failure")
    fake.set_status(out_of_time, JobState.timeout, "TIMEOUT")
    fake.set_status(cancelled, JobState.cancelled, "cancelled by an operator")
    tick(api)
    ends = [get_job(api, job_id)["state"] for job_id in (lost, out_of_time, cancelled)]
    assert ends == ["retrying", "timeout", "cancelled"]  # a node failure is retried by default
