"""service.domain.goodput.split on made-up histories: queue wait (requeues included), training, restart
downtime (to the first step after, or up to now) and recomputed work (since the checkpoint resumed
from, or the lost run's start)."""

from __future__ import annotations

import pytest

from service.domain.goodput import Span, spans, split
from service.states import JobState as S

QUEUED = [(0.0, S.queued), (10.0, S.submitted), (15.0, S.pending), (30.0, S.running)]


def test_a_run_without_restarts_is_queue_then_training() -> None:
    done = split([*QUEUED, (130.0, S.succeeded)], [], now=500.0)
    assert (done.queue_s, done.training_s, done.downtime_s, done.recomputed_s) == (30.0, 100.0, 0.0, 0.0)
    assert done.ratio == pytest.approx(100 / 130, abs=1e-4) and done.accruing is None


def test_a_running_job_accrues_training_up_to_now() -> None:
    now = split(QUEUED, [], now=90.0)
    assert now.training_s == 60.0 and now.accruing == "training"
    assert split([(0.0, S.queued)], [], now=5.0).accruing == "queue"


def test_a_requeue_and_a_retry_count_as_queue_wait() -> None:
    history = [*QUEUED, (50.0, S.retrying), (80.0, S.queued), (85.0, S.submitted), (90.0, S.running),
               (100.0, S.requeued), (110.0, S.pending), (120.0, S.running), (140.0, S.failed)]  # fmt: skip
    ended = split(history, [], now=1000.0)
    assert ended.queue_s == 30 + 40 + 20 and ended.training_s == 20 + 10 + 20


def test_a_restart_splits_downtime_and_recomputed_work_out_of_training() -> None:
    # Running from 30; a checkpoint saved at 60; the rank lost at 100; the first step after at 110.
    restart = Span(lost_at=100.0, run_start=30.0, checkpoint_at=60.0, first_step_at=110.0)
    ended = split([*QUEUED, (200.0, S.succeeded)], [restart], now=500.0)
    assert ended.downtime_s == 10.0 and ended.recomputed_s == 40.0
    assert ended.training_s == 170 - 10 - 40 and ended.queue_s == 30.0
    assert ended.ratio == pytest.approx(120 / 200, abs=1e-4)


def test_no_checkpoint_or_an_older_one_loses_the_whole_run() -> None:
    from_start = Span(lost_at=100.0, run_start=30.0, checkpoint_at=None, first_step_at=105.0)
    older = Span(lost_at=100.0, run_start=30.0, checkpoint_at=5.0, first_step_at=105.0)
    for restart in (from_start, older):
        assert split(QUEUED, [restart], now=120.0).recomputed_s == 70.0


def test_downtime_runs_up_to_now_until_a_step_is_reported_and_never_past_the_end() -> None:
    open_ = Span(lost_at=100.0, run_start=30.0, checkpoint_at=90.0)
    running = split(QUEUED, [open_], now=130.0)
    assert running.downtime_s == 30.0 and running.accruing == "downtime"
    ended = split([*QUEUED, (120.0, S.failed)], [open_], now=900.0)
    assert ended.downtime_s == 20.0 and ended.training_s == 90 - 20 - 10


def test_parts_stay_within_the_running_time_whatever_the_clocks_say() -> None:
    skewed = Span(lost_at=-50.0, run_start=-100.0, checkpoint_at=None, first_step_at=10_000.0)
    got = split([*QUEUED, (40.0, S.failed)], [skewed], now=50.0)
    assert got.training_s >= 0 and got.downtime_s + got.recomputed_s + got.training_s == pytest.approx(10.0)


def test_an_empty_history_has_no_ratio() -> None:
    assert split([], [], now=1.0).ratio is None


def test_spans_come_from_the_restart_log_and_skip_what_is_no_usable_restart() -> None:
    log = [
        {"attempt": 1, "restart": 1, "outcome": "restarted", "lost_at": 100.0, "run_start": 30.0,
         "checkpoint_at": 60.0, "first_step_at": 110.0},
        {"attempt": 1, "restart": 2, "outcome": "restarted"},  # no time: nothing to count
        {"attempt": 1, "restart": 2, "outcome": "gave_up", "reason": "restarts spent (2 of 2)"},
    ]  # fmt: skip
    assert spans(log) == [Span(100.0, 30.0, 60.0, 110.0)]
