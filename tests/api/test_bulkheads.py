"""Bulkheads: what one job wrote, or one unexpected error on one job, costs that job, never the tick.

Every test puts a hostile job beside a healthy one in the same tick, and the healthy one must get on
as if it were alone; the hostile one gets a reason its user can read, and ends. The hostile files are
the shapes issue 35 found (PoCs): digits that str.isdigit() takes and int() refuses, a lone surrogate
in a checkpoint path, NUL in an error file (which PostgreSQL refuses in a reason), and an error that
nothing expects.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service import bulkhead
from service.app import create_app
from service.bulkhead import FAIL_AFTER
from service.config import Settings
from service.loops import reconcile
from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import JOBS, authorize, get_job, runtime_of, submit, wait_state
from worker.spec import JobFiles


@pytest.fixture
def quiet_api(settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend) -> Iterator[TestClient]:
    """The service with reconcile loops that never tick on their own: the test drives each tick (the
    loop between ticks still ends jobs whose result appears)."""
    fake.poll_interval_s = fake_slurm.poll_interval_s = 3600.0
    settings = settings.model_copy(update={"ending_files_grace_s": 0.0})  # each tick decides what it sees
    with TestClient(create_app(settings, backends={"local": fake, "slurm": fake_slurm})) as client:
        fake.set_wakeup(lambda: None)  # a scripted status wakes no tick of the loop's own
        yield authorize(client)


def two_running(api: TestClient, fake: FakeBackend) -> tuple[int, int]:
    """A hostile job and a healthy one of the same user, both submitted and running."""
    hostile, healthy = submit(api, name="hostile")["id"], submit(api, name="healthy")["id"]
    for job_id in (hostile, healthy):
        wait_state(api, job_id, "submitted")
    tick(api)
    assert {get_job(api, hostile)["state"], get_job(api, healthy)["state"]} == {"running"}
    return hostile, healthy


def tick(api: TestClient) -> None:
    runtime_of(api).reconciler.reconcile_once("local")


def files_of(fake: FakeBackend, job_id: int) -> JobFiles:
    return fake.specs[job_id].files


def healthy_succeeds(api: TestClient, fake: FakeBackend, job_id: int) -> None:
    files = files_of(fake, job_id)
    files.progress.write_text(json.dumps({"step": 1, "metrics": {"loss": 0.5}, "attempt": 1}) + "\n")
    fake.finish(job_id, {"loss": 0.5})
    tick(api)  # or the loop's look for results between ticks, whichever comes first
    job = wait_state(api, job_id, "succeeded")
    assert job["result"] == {"loss": 0.5} and job["progress"]["step"] == 1


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("error-rank\u00b2.txt", "Traceback: a rank numbered with a superscript two\n"),
        ("error-rank0.txt", "attempt: \u00b2\nTraceback: an attempt numbered with a superscript two\n"),
        ("error-rank0.txt", "attempt: " + "9" * 5000 + "\nTraceback: an attempt int() refuses\n"),
        ("error-rank0.txt", "Traceback (most recent call last):\nValueError: a NUL \x00 in the reason\n"),
    ],
)
def test_an_error_file_a_job_wrote_costs_only_that_job(
    quiet_api: TestClient, fake: FakeBackend, name: str, content: str
) -> None:
    hostile, healthy = two_running(quiet_api, fake)
    (files_of(fake, hostile).folder / name).write_text(content)

    healthy_succeeds(quiet_api, fake, healthy)
    fake.set_status(hostile, JobState.failed, "exited", 1)
    tick(quiet_api)

    ended = get_job(quiet_api, hostile)
    assert ended["state"] == "failed"
    assert "\x00" not in ended["reason"]
    if name == "error-rank0.txt":  # its own rank's traceback is its reason
        assert "Traceback" in ended["reason"]


def test_a_checkpoint_path_no_column_can_hold_is_skipped_and_the_rest_read(
    quiet_api: TestClient, fake: FakeBackend
) -> None:
    hostile, healthy = two_running(quiet_api, fake)
    lines = [
        '{"checkpoint": "/jobs/1/checkpoints/ckpt-\\ud800.pt", "attempt": 1}',
        json.dumps({"checkpoint": "/x/" + "a" * 5000, "attempt": 1}),
        json.dumps({"step": 3, "total": 10, "metrics": {"loss": 1.5}, "attempt": 1}),
    ]
    files_of(fake, hostile).progress.write_text("\n".join(lines) + "\n")

    healthy_succeeds(quiet_api, fake, healthy)

    job = get_job(quiet_api, hostile)
    assert job["state"] == "running" and job["latest_checkpoint"] is None
    assert job["progress"]["step"] == 3  # the offset moved past the lines it could not use


def test_an_unexpected_error_on_one_job_is_told_on_it_and_fails_it_after_a_few_ticks(
    quiet_api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    hostile, healthy = two_running(quiet_api, fake)
    real = reconcile.ingest_progress

    def breaks_on_the_hostile_job(session: Any, job: Any, path: Any) -> bool:
        if job.id == hostile:
            job.progress = {"step": 999}  # a write the savepoint must undo
            raise RuntimeError("nothing expects this")
        return real(session, job, path)

    monkeypatch.setattr(reconcile, "ingest_progress", breaks_on_the_hostile_job)
    faults_before = runtime_of(quiet_api).reconciler.bulkhead.faults_total

    tick(quiet_api)
    first = get_job(quiet_api, hostile)
    assert first["state"] == "running" and first["progress"] is None
    assert first["reason"].startswith(f"reconciling failed on this job (1 of {FAIL_AFTER}")
    assert "RuntimeError: nothing expects this" in first["reason"]

    healthy_succeeds(quiet_api, fake, healthy)  # the same ticks go on for everyone else
    for _ in range(FAIL_AFTER - 2):
        tick(quiet_api)
    failed = get_job(quiet_api, hostile)
    assert failed["state"] == "failed", failed["reason"]
    assert f"({FAIL_AFTER} of {FAIL_AFTER}: the job fails)" in failed["reason"]
    assert [fake.external_id(hostile)] in fake.cancel_calls  # its ranks are stopped
    assert runtime_of(quiet_api).reconciler.bulkhead.faults_total == faults_before + FAIL_AFTER
    metrics = quiet_api.get("/metrics").text
    assert 'torchyard_job_faults_total{step="reconciling"}' in metrics


def test_a_job_that_recovers_between_faults_starts_counting_again() -> None:
    guard = bulkhead.Bulkhead("testing")

    def fails() -> None:
        raise ValueError("once")

    assert isinstance(guard.guarded(1, fails), bulkhead.Fault)
    assert guard.guarded(1, lambda: "fine") == "fine"
    again = guard.guarded(1, fails)
    assert isinstance(again, bulkhead.Fault) and again.count == 1 and not again.gives_up


def test_an_unexpected_error_preparing_one_job_leaves_the_batch_going_out(
    api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 35, finding 3: on Python 3.11.2 one code snapshot's unpack raised TypeError, and the
    dispatcher released its whole batch, every tick."""
    from service.loops import dispatch

    real = dispatch.make_job_folder

    def breaks_for_one(files: JobFiles, *rest: Any) -> None:
        if files.folder.name == str(hostile):
            raise TypeError("extractall() got an unexpected keyword argument 'filter'")
        real(files, *rest)

    monkeypatch.setattr(dispatch, "make_job_folder", breaks_for_one)
    runtime = runtime_of(api)
    runtime.dispatcher.stop()  # the two arrive in one batch
    hostile, healthy = submit(api, name="hostile")["id"], submit(api, name="healthy")["id"]
    for _ in range(FAIL_AFTER):
        runtime.dispatcher.dispatch_once()

    assert get_job(api, healthy)["state"] != "queued"
    assert fake.submit_calls == [[healthy]]
    failed = get_job(api, hostile)
    assert failed["state"] == "failed"
    assert failed["reason"].startswith(f"dispatching failed on this job ({FAIL_AFTER} of {FAIL_AFTER}")
    assert "TypeError" in failed["reason"]
    events = api.get(f"{JOBS}/{hostile}/events").json()
    assert [event["to_state"] for event in events] == ["queued", "failed"]


def test_a_backend_that_raises_on_one_job_of_a_batch_takes_the_others(
    api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = fake.submit

    def raises_for_one(specs: Any) -> Any:
        if any(spec.name == "hostile" for spec in specs):
            raise KeyError("something about the hostile job")
        return real(specs)

    monkeypatch.setattr(fake, "submit", raises_for_one)
    runtime = runtime_of(api)
    runtime.dispatcher.stop()
    hostile, healthy = submit(api, name="hostile")["id"], submit(api, name="healthy")["id"]
    runtime.dispatcher.dispatch_once()

    assert get_job(api, healthy)["state"] != "queued"
    waiting = get_job(api, hostile)
    assert waiting["state"] == "queued" and "KeyError" in waiting["reason"]
