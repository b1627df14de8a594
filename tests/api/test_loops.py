"""The dispatch and reconcile loops, driven through the API against fake backends.

Dispatch: queued -> submitted in batches; a backend failure leaves the job queued with the reason and
is retried. Reconcile: ONE poll per backend per tick for all its active jobs, and API readers never
cause a poll; the scheduler's states and words reach the ledger.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from service import jobfs
from service.app import create_app
from service.config import Settings
from service.domain.transitions import record_waiting
from service.ledger.db import session_scope
from service.ledger.models.columns import utcnow
from service.states import JobState
from tests.fakes import FakeBackend
from tests.support import JOBS, authorize, get_job, runtime_of, submit, wait_for, wait_state
from worker.spec import JobFiles


def events(api: TestClient, job_id: int) -> list[dict[str, Any]]:
    response = api.get(f"{JOBS}/{job_id}/events")
    assert response.status_code == 200
    found: list[dict[str, Any]] = response.json()
    return found


# ---------------------------------------------------------------- dispatch


def test_dispatch_hands_a_queued_job_to_its_backend(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api)["id"]

    job = wait_for(lambda: (j := get_job(api, job_id))["state"] != "queued" and j, what="dispatch")

    assert job["external_id"] == fake.external_id(job_id)
    assert job["submitted_at"] is not None
    assert fake.specs[job_id].entrypoint == "worker.tasks.seed:ddp_step"
    assert fake.specs[job_id].folder == job["folder"]
    assert [e["to_state"] for e in events(api, job_id)][:2] == ["queued", "submitted"]


def test_each_job_goes_to_the_backend_it_names(
    api: TestClient, fake: FakeBackend, fake_slurm: FakeBackend
) -> None:
    local = submit(api)["id"]
    slurm = submit(api, backend="slurm", resources={"nodes": 2, "tasks_per_node": 2})["id"]

    wait_state(api, local, "running")
    wait_state(api, slurm, "pending")

    assert set(fake.specs) == {local}
    assert set(fake_slurm.specs) == {slurm}
    assert fake_slurm.specs[slurm].resources.world_size == 4


def test_a_backend_failure_leaves_the_job_queued_with_the_reason_and_is_retried(
    api: TestClient, fake: FakeBackend
) -> None:
    fake.submit_error = "slurmctld is not responding"
    job_id = submit(api)["id"]
    wait_for(lambda: len(fake.submit_calls) >= 2, what="two dispatch attempts")

    waiting = get_job(api, job_id)
    assert waiting["state"] == "queued"
    assert waiting["reason"] == "dispatch failed, will retry: slurmctld is not responding"
    assert waiting["external_id"] is None

    fake.submit_error = None
    running = wait_state(api, job_id, "running")

    assert running["external_id"] == fake.external_id(job_id)
    assert [e["to_state"] for e in events(api, job_id)].count("submitted") == 1


def test_a_job_the_backend_rejects_fails_at_once_with_its_words(api: TestClient, fake: FakeBackend) -> None:
    fake.reject["too-big"] = "sbatch: error: Batch job submission failed: Requested node configuration"
    fake.submit_error = "hold"  # let both jobs land in the same batch
    bad = submit(api, name="too-big")["id"]
    good = submit(api, name="fine")["id"]
    wait_for(lambda: fake.submit_calls and len(fake.submit_calls[-1]) == 2, what="one batch of two")
    fake.submit_error = None

    failed = wait_state(api, bad, "failed")

    assert failed["reason"] == fake.reject["too-big"]
    assert wait_state(api, good, "running")["external_id"] == fake.external_id(good)


def test_a_job_left_out_when_the_scheduler_stopped_answering_mid_batch_is_queued_again(
    api: TestClient, fake: FakeBackend
) -> None:
    fake.unreachable["late"] = "not submitted, SLURM became unreachable: connect failure"
    fake.submit_error = "hold"  # let both jobs land in the same batch
    late = submit(api, name="late")["id"]
    early = submit(api, name="early")["id"]
    wait_for(lambda: fake.submit_calls and len(fake.submit_calls[-1]) == 2, what="one batch of two")
    fake.submit_error = None
    wait_state(api, early, "running")
    wait_for(lambda: len(fake.submit_calls) >= 3, what="the left-out job dispatched again")

    waiting = get_job(api, late)
    assert waiting["state"] == "queued"
    assert waiting["reason"] == f"dispatch failed, will retry: {fake.unreachable['late']}"

    del fake.unreachable["late"]
    assert wait_state(api, late, "running")["external_id"] == fake.external_id(late)
    assert [e["to_state"] for e in events(api, late)].count("submitted") == 1


def test_jobs_that_arrive_together_are_submitted_together(api: TestClient, fake: FakeBackend) -> None:
    fake.submit_error = "hold"
    created = [submit(api, name=f"b{n}")["id"] for n in range(20)]
    wait_for(lambda: fake.submit_calls and len(fake.submit_calls[-1]) == 20, what="a claim of all 20")

    fake.submit_error = None
    for job_id in created:
        wait_state(api, job_id, "running")

    assert sorted(fake.submit_calls[-1]) == sorted(created)  # one call for the lot
    assert sorted(fake.specs) == sorted(created)
    assert all([e["to_state"] for e in events(api, job_id)].count("submitted") == 1 for job_id in created)


# ---------------------------------------------------------------- reconcile: one query per tick


@pytest.fixture
def quiet_api(settings: Settings, fake: FakeBackend, fake_slurm: FakeBackend) -> Iterator[TestClient]:
    """The service with reconcile loops that never tick on their own: the test drives each tick."""
    fake.poll_interval_s = fake_slurm.poll_interval_s = 3600.0  # each backend declares its interval
    with TestClient(create_app(settings, backends={"local": fake, "slurm": fake_slurm})) as client:
        yield authorize(client)


def read_everything(api: TestClient, job_id: int, readers: int = 20, rounds: int = 1) -> int:
    """`readers` threads polling every read endpoint, as dashboards and CLIs do; returns the count."""
    paths = [
        JOBS,
        f"{JOBS}?state=running",
        *(f"{JOBS}/{job_id}{s}" for s in ("", "/events", "/metrics", "/logs")),
    ]
    statuses: list[int] = []

    def reader() -> None:
        for _ in range(rounds):
            statuses.extend(api.get(path).status_code for path in paths)

    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert set(statuses) == {200}
    return len(statuses)


def test_one_poll_per_tick_for_all_active_jobs_and_none_for_readers(
    quiet_api: TestClient, fake: FakeBackend, fake_slurm: FakeBackend
) -> None:
    api = quiet_api
    reconciler = runtime_of(api).reconciler
    local = [submit(api, name=f"l{n}")["id"] for n in range(20)]
    slurm = [submit(api, name=f"s{n}", backend="slurm")["id"] for n in range(5)]
    for job_id in local + slurm:
        wait_state(api, job_id, "submitted")
    polls_before = len(fake.poll_calls)

    assert reconciler.reconcile_once("local") == 20

    assert len(fake.poll_calls) == polls_before + 1
    assert sorted(fake.poll_calls[-1]) == sorted(fake.external_id(j) for j in local)
    assert fake_slurm.poll_calls == []  # one backend's tick never queries another
    assert all(get_job(api, j)["state"] == "running" for j in local)

    assert read_everything(api, local[0]) == 120
    assert len(fake.poll_calls) == polls_before + 1  # 20 readers, 120 requests: no poll
    assert fake_slurm.poll_calls == []

    reconciler.reconcile_once("slurm")
    assert len(fake_slurm.poll_calls) == 1 and len(fake_slurm.poll_calls[0]) == 5
    assert all(get_job(api, j)["state"] == "pending" for j in slurm)


def test_the_loop_polls_once_per_interval_with_every_active_job(api: TestClient, fake: FakeBackend) -> None:
    created = [submit(api, name=f"j{n}")["id"] for n in range(10)]
    for job_id in created:
        wait_state(api, job_id, "running")
    start = len(fake.poll_calls)
    wait_for(lambda: len(fake.poll_calls) >= start + 5, what="five more ticks")

    later = fake.poll_calls[start : start + 5]
    assert all(sorted(call) == sorted(fake.external_id(j) for j in created) for call in later)


def test_finished_jobs_are_no_longer_polled(quiet_api: TestClient, fake: FakeBackend) -> None:
    api = quiet_api
    reconciler = runtime_of(api).reconciler
    done, running = submit(api, name="done")["id"], submit(api, name="running")["id"]
    wait_state(api, done, "submitted")
    wait_state(api, running, "submitted")
    fake.finish(done, 1)  # wakes the reconcile thread too: whichever tick takes the row settles it
    reconciler.reconcile_once("local")
    wait_state(api, done, "succeeded")

    reconciler.reconcile_once("local")

    assert fake.poll_calls[-1] == [fake.external_id(running)]


# ---------------------------------------------------------------- reconcile: what reaches the ledger


def test_the_pending_reason_is_kept(api: TestClient, fake_slurm: FakeBackend) -> None:
    job_id = submit(api, backend="slurm")["id"]
    wait_state(api, job_id, "pending")

    fake_slurm.set_status(job_id, JobState.pending, "Resources")

    wait_for(lambda: get_job(api, job_id)["reason"] == "Resources", what="the pending reason")


def test_a_tick_over_a_still_queue_costs_one_statement_not_one_per_job(
    quiet_api: TestClient, fake_slurm: FakeBackend
) -> None:
    api = quiet_api
    runtime = runtime_of(api)
    waiting = [submit(api, name=f"w{n}", backend="slurm")["id"] for n in range(40)]
    for job_id in waiting:
        wait_state(api, job_id, "submitted")
    # A leftover of an earlier attempt: only running ranks write these, so it must not fail a job
    # that waits in the queue (nor be looked for, on every tick, in every waiting job's folder).
    leftover = "Traceback (most recent call last):\nRuntimeError: from the attempt before\n"
    fake_slurm.specs[waiting[0]].files.error(0).write_text(leftover)
    runtime.reconciler.reconcile_once("slurm")
    before = {job_id: get_job(api, job_id) for job_id in waiting}
    assert {job["state"] for job in before.values()} == {"pending"}

    statements: list[str] = []
    tick_thread = threading.get_ident()  # the dispatcher's own ticks run meanwhile, on its thread

    def listener(*args: Any) -> None:  # (conn, cursor, statement, ...)
        if threading.get_ident() == tick_thread:
            statements.append(args[2])

    event.listen(runtime.engine, "before_cursor_execute", listener)
    try:
        assert runtime.reconciler.reconcile_once("slurm") == 40
    finally:
        event.remove(runtime.engine, "before_cursor_execute", listener)

    assert len(statements) == 1, statements  # the one SELECT of the watched jobs; no lock per job
    assert len(fake_slurm.poll_calls[-1]) == 40
    assert {job_id: get_job(api, job_id) for job_id in waiting} == before  # nothing written

    fake_slurm.set_status(waiting[1], JobState.pending, "Priority")  # wakes the loop's own tick too
    runtime.reconciler.reconcile_once("slurm")
    # A new reason is still a change: written by this tick, or by the loop's, whichever locked the row.
    wait_for(lambda: get_job(api, waiting[1])["reason"] == "Priority", 5, "the new pending reason")


def test_jobs_the_scheduler_queued_move_to_pending_together_each_with_its_event(
    quiet_api: TestClient, fake_slurm: FakeBackend
) -> None:
    api = quiet_api
    queued = [submit(api, name=f"q{n}", backend="slurm")["id"] for n in range(12)]
    for job_id in queued:
        wait_state(api, job_id, "submitted")
    tags = {job_id: api.get(f"{JOBS}/{job_id}").headers["etag"] for job_id in queued}

    runtime_of(api).reconciler.reconcile_once("slurm")

    for job_id in queued:
        job = get_job(api, job_id)
        assert (job["state"], job["reason"], job["attempt"]) == ("pending", None, 1)
        history = [(e["from_state"], e["to_state"], e["attempt"]) for e in events(api, job_id)]
        assert history == [(None, "queued", 1), ("queued", "submitted", 1), ("submitted", "pending", 1)]
        assert api.get(f"{JOBS}/{job_id}").headers["etag"] != tags[job_id]  # readers see the change


def test_a_job_written_since_the_poll_is_left_for_the_next_tick(quiet_api: TestClient) -> None:
    api = quiet_api
    engine = runtime_of(api).engine
    job_id = submit(api, backend="slurm")["id"]
    wait_state(api, job_id, "submitted")

    with session_scope(engine) as session:
        stale = record_waiting(session, {job_id: "Resources"}, unchanged_since=utcnow() - timedelta(hours=1))
    assert stale == [] and get_job(api, job_id)["state"] == "submitted"

    with session_scope(engine) as session:
        moved = record_waiting(session, {job_id: "Resources"}, unchanged_since=utcnow())
    assert moved == [job_id]
    assert (get_job(api, job_id)["state"], get_job(api, job_id)["reason"]) == ("pending", "Resources")

    with session_scope(engine) as session:  # no longer submitted: nothing to move, no second event
        assert record_waiting(session, {job_id: "Priority"}, unchanged_since=utcnow()) == []
    assert [e["to_state"] for e in events(api, job_id)].count("pending") == 1


def test_a_failed_job_keeps_its_reason_and_exit_code(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")

    fake.set_status(job_id, JobState.failed, "NonZeroExitCode", exit_code=3)

    job = wait_state(api, job_id, "failed")
    assert job["exit_code"] == 3 and job["reason"] == "NonZeroExitCode" and job["result"] is None


def test_a_rank_that_raises_is_left_to_the_supervisor_and_its_traceback_ends_the_attempt(
    api: TestClient, fake: FakeBackend
) -> None:
    """The job's supervisor (worker.supervisor) ends or restarts a run whose rank raised; the service
    does not end the attempt on the error file alone (it may be restarted from), only once the job's
    processes have ended, and then the traceback is its reason."""
    job_id = submit(api, resources={"tasks_per_node": 2})["id"]
    job = wait_state(api, job_id, "running")
    traceback = 'Traceback (most recent call last):\n  File "train.py"\nValueError: bad batch\n'
    (fake.specs[job_id].files.error(1)).write_text(traceback)
    runtime_of(api).reconciler.reconcile_once("local")
    assert get_job(api, job_id)["state"] == "running" and fake.cancel_calls == []

    fake.set_status(job_id, JobState.failed, None, 1)  # the supervisor ended the attempt
    failed = wait_state(api, job_id, "failed")

    assert failed["reason"].startswith("rank 1 raised:")
    assert "ValueError: bad batch" in failed["reason"]
    assert job["external_id"]


def test_what_rank_0_reported_just_before_its_attempt_ended_reaches_the_ledger(
    quiet_api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = quiet_api
    reconciler = runtime_of(api).reconciler
    job_id = submit(api)["id"]
    wait_state(api, job_id, "submitted")
    files = fake.specs[job_id].files

    def report(step: int) -> None:
        with files.progress.open("a") as handle:
            handle.write(json.dumps({"step": step, "metrics": {"loss": 1 / step}, "attempt": 1}) + "\n")

    report(1)
    reconciler.reconcile_once("local")
    assert get_job(api, job_id)["state"] == "running"
    # Rank 0 reports its last loss and writes its result after the tick has read the progress file and
    # before it looks for the result. (An attempt that fails ends once its processes have: they write
    # nothing after the status poll that says so.)
    def ended_meanwhile(looked_in: JobFiles, attempt: int | None) -> Any:
        report(2)
        files.result.write_text(json.dumps({"attempt": attempt, "value": "done"}))
        return jobfs.read_result(looked_in, attempt)

    monkeypatch.setattr("service.loops.reconcile.read_result", ended_meanwhile)

    reconciler.reconcile_once("local")

    assert get_job(api, job_id)["state"] == "succeeded"
    metrics = api.get(f"{JOBS}/{job_id}/metrics").raise_for_status().json()
    assert [(m["step"], m["value"]) for m in metrics] == [(1, 1.0), (2, 0.5)]


def test_a_job_that_ends_without_a_result_is_failed_not_succeeded(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")

    fake.set_status(job_id, JobState.succeeded, "process ended", exit_code=0)

    assert wait_state(api, job_id, "failed")["reason"].startswith("ended without a result")


def test_a_job_over_its_time_limit_ends_timeout(api: TestClient, fake_slurm: FakeBackend) -> None:
    job_id = submit(api, backend="slurm")["id"]
    wait_state(api, job_id, "pending")

    fake_slurm.set_status(job_id, JobState.timeout, "TIMEOUT")

    assert wait_state(api, job_id, "timeout")["reason"] == "TIMEOUT"


def test_preemption_and_requeue_start_a_new_attempt(api: TestClient, fake_slurm: FakeBackend) -> None:
    job_id = submit(api, backend="slurm")["id"]
    fake_slurm.default = JobState.running
    wait_state(api, job_id, "running")

    fake_slurm.set_status(job_id, JobState.preempted, "PREEMPTED")
    wait_state(api, job_id, "preempted")
    fake_slurm.set_status(job_id, JobState.requeued, "REQUEUED")
    wait_state(api, job_id, "requeued")
    fake_slurm.set_status(job_id, JobState.running)
    job = wait_state(api, job_id, "running")

    assert job["attempt"] == 2
    history = [(e["to_state"], e["attempt"]) for e in events(api, job_id)]
    assert history[-3:] == [("preempted", 1), ("requeued", 2), ("running", 2)]


def test_a_result_is_noticed_between_ticks_without_asking_the_scheduler(settings: Settings) -> None:
    """Rank 0's result ends the job within a result pass (RESULT_CHECK_S), not at the next tick: the
    result is written just after a tick, and the job ends long before the next one, with no poll."""
    slow = FakeBackend("slurm", poll_interval_s=5)
    with TestClient(create_app(settings, backends={"local": FakeBackend("local"), "slurm": slow})) as client:
        api = authorize(client)
        job_id = submit(api, backend="slurm")["id"]
        wait_for(lambda: slow.polled_ids > 0, 10, "a tick that polls it")  # watched from now on
        polls = len(slow.poll_calls)
        slow.specs[job_id].files.result.write_text('{"attempt": 1, "value": {"ok": true}}')
        started = time.monotonic()
        done = wait_state(api, job_id, "succeeded", timeout=5)
        took = time.monotonic() - started

    assert done["result"] == {"ok": True} and done["reason"] == "completed"
    assert took < 1.5, f"{took:.2f} s"
    assert len(slow.poll_calls) == polls  # no scheduler call made it


def test_a_job_that_runs_on_after_its_result_is_stopped(
    api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The result ends the job for its user at once; its processes get a grace to exit, and are
    stopped if the scheduler still lists them running after it (a job may write its result early
    and go on, outside its quota)."""
    monkeypatch.setattr("service.loops.reconcile.REAP_GRACE_S", 0.5)
    job_id = submit(api)["id"]
    wait_state(api, job_id, "running")
    fake.specs[job_id].files.result.write_text('{"attempt": 1, "value": {"ok": true}}')  # still "running"

    wait_state(api, job_id, "succeeded")
    wait_for(lambda: [fake.external_id(job_id)] in fake.cancel_calls, 5, "the leftover run to be stopped")

    assert get_job(api, job_id)["state"] == "succeeded"  # stopping it changes nothing in the ledger
