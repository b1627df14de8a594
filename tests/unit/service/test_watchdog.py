"""The watchdog's decision (service.domain.watchdog, pure), its spec field, the stall flag through the
transitions door, the `hang` ending and its retry, and endings that carry the last stacks summary."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.domain import watchdog
from service.domain.endings import Ending, with_stacks
from service.domain.transitions import clear_stall, end_attempt, record_stall, record_transition
from service.ledger.db import make_engine, migrate
from service.ledger.models.history import JobAttempt, JobEvent
from service.ledger.models.jobs import Job, JobCreate, RetryPolicy
from service.loops.watch import judge
from service.states import JobState
from worker.spec import JobFiles, Watchdog

NOW = 1_000_000.0


@dataclass(frozen=True)
class Seen:
    """A rank's activity file, as worker.stacks writes it."""

    rank: int
    changed_at: float
    time: float = NOW - 1
    where: str | None = "job.py:10 step"
    host: str = "n1"
    attempt: int = 1


def decide(
    *,
    watch: Watchdog | None = None,
    world: int = 3,
    started_at: float | None = NOW - 3600,
    progress_at: float | None = None,
    report_times: list[float] | None = None,
    activity: list[Seen] | None = None,
    now: float = NOW,
) -> watchdog.Verdict:
    return watchdog.decide(
        now=now,
        watchdog=watch,
        attempt=1,
        world=world,
        started_at=started_at,
        progress_at=progress_at,
        report_times=report_times or [],
        activity=activity or [],
    )


def every(seconds: float, count: int, last: float) -> list[float]:
    return [last - seconds * index for index in reversed(range(count))]


# ---------------------------------------------------------------- the threshold


def test_a_job_that_reports_every_2_s_and_stops_for_2_minutes_is_stalled() -> None:
    times = every(2, 16, NOW - 121)
    verdict = decide(progress_at=NOW - 121, report_times=times)
    assert verdict.threshold_s == 120 and verdict.stalled
    assert not decide(progress_at=NOW - 100, report_times=every(2, 16, NOW - 100)).stalled


def test_a_job_whose_steps_take_10_minutes_is_not_stalled_within_a_step() -> None:
    times = every(600, 5, NOW - 590)
    verdict = decide(progress_at=NOW - 590, report_times=times)
    assert verdict.threshold_s == 6000 and not verdict.stalled
    assert "10x its usual 600 s" in verdict.basis


def test_healthy_20_s_steps_with_a_short_threshold_are_never_stalled() -> None:
    watch = Watchdog(stall_after_s=30)
    for since_report in (0.0, 5.0, 19.9, 25.0):  # a report every 20 s: never 30 s without one
        reports = every(20, 16, NOW)
        assert not decide(watch=watch, progress_at=NOW - since_report, report_times=reports).stalled


def test_a_job_that_reports_nothing_is_judged_by_its_ranks_activity() -> None:
    busy = [Seen(rank, changed_at=NOW - 4) for rank in range(3)]
    assert not decide(activity=busy).stalled  # the default 300 s since the last change: far off
    stuck = [Seen(0, NOW - 301), Seen(1, NOW - 400, where="job.py:5 hang"), Seen(2, NOW - 302)]
    verdict = decide(activity=stuck)
    assert verdict.threshold_s == 300 and verdict.stalled
    assert "threshold 300 s" in (verdict.reason or "")


def test_the_last_rank_to_change_decides_and_a_report_counts_as_progress() -> None:
    # Rank 1 stopped 200 s ago; the others run on: the job waits for rank 1.
    activity = [Seen(0, NOW - 1), Seen(1, NOW - 200, where="job.py:5 hang"), Seen(2, NOW - 1)]
    assert decide(watch=Watchdog(stall_after_s=60), activity=activity).stalled
    assert not decide(watch=Watchdog(stall_after_s=60), activity=activity, progress_at=NOW - 10).stalled


def test_the_reason_names_the_odd_rank_where_it_is_and_groups_the_others() -> None:
    activity = [
        Seen(0, NOW - 130, where="job.py:30 step"),
        Seen(1, NOW - 140, where="job.py:12 sleep_forever", host="n2"),
        Seen(2, NOW - 131, where="job.py:30 step"),
    ]
    verdict = decide(watch=Watchdog(stall_after_s=60), activity=activity)
    assert verdict.reason == (
        "no progress for 2.3 min (threshold 60 s: its watchdog.stall_after_s); "
        "rank 1 on n2 has been in job.py:12 sleep_forever for 2.3 min; ranks 0, 2 in job.py:30 step"
    )


def test_a_rank_whose_file_went_stale_is_stuck_and_said_so() -> None:
    # Its Python cannot run (C code holding the GIL): its file is not rewritten, its last change stands.
    activity = [Seen(0, NOW - 5, time=NOW - 1), Seen(1, NOW - 90, time=NOW - 80, where="job.py:7 regex")]
    verdict = decide(watch=Watchdog(stall_after_s=60), world=2, activity=activity)
    assert verdict.stalled
    assert "rank 1 on n1 stopped sampling (its Python cannot run) in job.py:7 regex" in (verdict.reason or "")


def test_a_rank_without_an_activity_file_counts_from_the_attempts_start() -> None:
    activity = [Seen(0, NOW - 1), Seen(2, NOW - 1)]  # rank 1 never wrote one
    assert not decide(watch=Watchdog(stall_after_s=60), activity=activity, started_at=NOW - 30).stalled
    verdict = decide(watch=Watchdog(stall_after_s=60), activity=activity, started_at=NOW - 61)
    assert verdict.stalled and "rank 1 wrote no activity" in (verdict.reason or "")


def test_nothing_to_go_by_is_never_a_stall() -> None:
    assert not decide(started_at=NOW - 10**6).stalled  # neither reports nor activity (an older worker)


def test_another_attempts_activity_and_a_clock_ahead_are_not_progress() -> None:
    old = [Seen(rank, NOW - 1, attempt=2 - 1) for rank in range(3)]
    verdict = watchdog.decide(
        now=NOW, watchdog=Watchdog(stall_after_s=60), attempt=2, world=3, started_at=NOW - 100,
        progress_at=None, report_times=[], activity=old,
    )  # fmt: skip
    assert not verdict.stalled and verdict.idle_s is None
    ahead = [Seen(rank, NOW + 500, time=NOW + 500) for rank in range(3)]
    assert decide(watch=Watchdog(stall_after_s=60), activity=ahead).idle_s == 0


def test_the_kept_report_times_are_the_last_sixteen() -> None:
    kept = watchdog.recent_report_times(list(range(10)), [float(n) for n in range(10, 20)])
    assert kept == [float(n) for n in range(4, 20)]


# ---------------------------------------------------------------- the spec field


def test_the_watchdog_field_defaults_to_none_and_takes_a_threshold_and_an_action() -> None:
    assert JobCreate(name="j", entrypoint="a.b:c").watchdog is None
    job = JobCreate(name="j", entrypoint="a.b:c", watchdog={"stall_after_s": 600, "on_stall": "fail"})  # type: ignore[arg-type]
    assert job.watchdog == Watchdog(stall_after_s=600, on_stall="fail")


@pytest.mark.parametrize(
    "watch",
    [{"stall_after_s": 1}, {"stall_after_s": float("inf")}, {"stall_after_s": -5}, {"stall_after_s": "x"},
     {"on_stall": "explode"}, {"after": 3}],
)  # fmt: skip
def test_a_bad_watchdog_is_refused_naming_its_field(watch: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as refused:
        JobCreate(name="j", entrypoint="a.b:c", watchdog=watch)  # type: ignore[arg-type]
    assert refused.value.errors()[0]["loc"][0] == "watchdog"
    assert refused.value.errors()[0]["loc"][1] in {*watch}


def test_hang_is_a_kind_retry_policies_accept() -> None:
    assert RetryPolicy(on=["hang"]).on == ["hang"]


# ---------------------------------------------------------------- the ledger


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    migrate(engine)
    yield engine
    engine.dispose()


def running(session: Session, policy: RetryPolicy | None = None) -> Job:
    job = Job(name="j", backend="local", spec={"entrypoint": "a.b:c"}, folder="/nowhere",
              retries=None if policy is None else policy.model_dump(mode="json"))  # fmt: skip
    session.add(job)
    session.flush()
    record_transition(session, job, JobState.submitted, "sent", external_id="1")
    record_transition(session, job, JobState.running)
    return job


def events(session: Session, job: Job) -> list[tuple[str, str, str | None]]:
    rows = session.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
    return [(str(row.from_state), str(row.to_state), row.reason) for row in rows]


def test_a_stall_is_a_flag_and_an_event_and_progress_clears_it(engine: Engine) -> None:
    with Session(engine) as session:
        job = running(session)
        record_stall(session, job, "rank 1 has been in job.py:5 hang")
        assert job.state is JobState.running and job.stalled_at is not None
        assert job.stall_reason == "rank 1 has been in job.py:5 hang"
        clear_stall(session, job)
        clear_stall(session, job)  # once only
        assert job.stalled_at is None and job.stall_reason is None
        said = events(session, job)[-2:]
        assert said[0] == ("running", "running", "stalled: rank 1 has been in job.py:5 hang")
        assert said[1][2] is not None and said[1][2].startswith("progress resumed after a stall of ")
        assert len(events(session, job)) == 4


def test_a_hang_ending_is_retried_when_the_policy_says_hang_and_clears_the_flag(engine: Engine) -> None:
    with Session(engine) as session:
        job = running(session, RetryPolicy(on=["hang"], backoff_s=0))
        job.report_times, job.progress_at = [1.0, 2.0], None
        record_stall(session, job, "stuck")
        end_attempt(session, job, Ending(JobState.failed, "hang", "stalled: stuck"))
        assert job.state is JobState.retrying and job.attempt == 2
        assert job.stalled_at is None and job.report_times is None  # the next attempt's own, once known
        first = session.exec(select(JobAttempt).where(JobAttempt.job_id == job.id)).one()
        assert (first.state, first.kind, first.reason) == (JobState.failed, "hang", "stalled: stuck")
        other = running(session)
        end_attempt(session, other, Ending(JobState.failed, "hang", "stalled"))  # default policy: no
        assert other.state is JobState.failed


def test_a_lost_peer_or_a_timeout_carries_the_stacks_summary_and_nothing_else_does() -> None:
    lost = Ending(JobState.failed, "node_failure", "rank 1 vanished")
    told = with_stacks(lost, "rank 1 on n2 in job.py:5 hang; ranks 0, 2 wait in all_reduce")
    assert told.reason == (
        "rank 1 vanished\nbefore the end: rank 1 on n2 in job.py:5 hang; ranks 0, 2 wait in all_reduce"
    )
    assert with_stacks(lost, None) is lost
    own = Ending(JobState.failed, "failure", "rank 0 raised")
    assert with_stacks(own, "anything") is own
    assert "before the end" in with_stacks(Ending(JobState.timeout, "timeout", "limit"), "x").reason
    gloo = Ending(JobState.failed, "failure", "rank 0 raised:\nRuntimeError: [../third_party/gloo/"
                  "gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for recv operation")
    summary = "rank 1 on n2 in job.py:5 hang"
    assert with_stacks(gloo, summary).reason.endswith(f"before the end: {summary}")  # a collective timed out


def test_a_job_that_reported_within_its_threshold_is_judged_without_reading_its_folder(
    tmp_path: Path,
) -> None:
    files = JobFiles(tmp_path)
    files.activity(0).parent.mkdir(parents=True)
    now = time.time()
    still = {
        "attempt": 1,
        "rank": 0,
        "host": "n1",
        "pid": 1,
        "time": now,
        "changed_at": now - 500,
        "where": "a:1 f",
    }
    files.activity(0).write_text(json.dumps(still))
    job = Job(name="j", backend="local", spec={"watchdog": {"stall_after_s": 60}}, folder=str(tmp_path),
              progress_at=datetime.fromtimestamp(now - 30, timezone.utc), report_times=[1.0])  # fmt: skip
    verdict = judge(job, now)
    assert not verdict.stalled and verdict.idle_s == pytest.approx(30)
    job.progress_at = datetime.fromtimestamp(now - 90, timezone.utc)  # its last report is too old
    assert judge(job, now).stalled
    job.progress_at, job.stalled_at = (
        datetime.fromtimestamp(now - 30, timezone.utc),
        datetime.now(timezone.utc),
    )
    assert not judge(job, now).stalled  # a flagged job is judged whole: its report clears it
