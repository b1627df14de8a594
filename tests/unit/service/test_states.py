"""The one job state machine: every allowed transition, refused ones, terminal states, attempts."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.domain.transitions import record_transition
from service.ledger.db import make_engine, migrate
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job
from service.states import (
    ACTIVE_STATES,
    ALLOWED_TRANSITIONS,
    DISPATCHABLE_STATES,
    TERMINAL_STATES,
    WATCHED_STATES,
    IllegalTransition,
    JobState,
    can_transition,
    check_transition,
    is_terminal,
    starts_new_attempt,
)

S = JobState
ALLOWED = [(a, b) for a, targets in ALLOWED_TRANSITIONS.items() for b in sorted(targets)]
REFUSED = [(a, b) for a in S for b in S if b not in ALLOWED_TRANSITIONS[a] and a is not b]


# ---------------------------------------------------------------- the table


def test_every_state_has_a_row() -> None:
    assert set(ALLOWED_TRANSITIONS) == set(S)


@pytest.mark.parametrize(("current", "target"), ALLOWED, ids=lambda s: s.value)
def test_every_allowed_transition_is_allowed(current: JobState, target: JobState) -> None:
    assert can_transition(current, target)
    check_transition(current, target)  # does not raise


@pytest.mark.parametrize(
    "path",
    [
        [S.queued, S.submitted, S.pending, S.running, S.succeeded],
        [S.queued, S.submitted, S.pending, S.running, S.failed],
        [S.queued, S.submitted, S.pending, S.running, S.timeout],
        [S.queued, S.submitted, S.pending, S.cancelled],
        [S.queued, S.cancelled],
        [S.queued, S.failed],  # the backend refused it
        [S.queued, S.submitted, S.running, S.preempted, S.requeued, S.pending, S.running, S.succeeded],
        [S.queued, S.submitted, S.running, S.requeued, S.running, S.succeeded],
        [S.queued, S.submitted, S.running, S.retrying, S.submitted, S.running, S.succeeded],
        [S.queued, S.submitted, S.pending, S.retrying, S.cancelled],  # cancelled during the backoff
    ],
    ids=lambda path: "->".join(s.value for s in path),
)
def test_the_lifecycles_the_issue_names_are_allowed(path: list[JobState]) -> None:
    for current, target in pairwise(path):
        assert can_transition(current, target), (current, target)


@pytest.mark.parametrize(
    ("current", "target"),
    [
        (S.queued, S.running),  # never handed to a backend
        (S.queued, S.pending),
        (S.queued, S.succeeded),
        (S.submitted, S.queued),
        (S.running, S.queued),
        (S.running, S.submitted),
        (S.pending, S.requeued),  # requeue follows a preemption or a run
        (S.succeeded, S.running),
        (S.failed, S.queued),
        (S.cancelled, S.running),
        (S.timeout, S.succeeded),
    ],
    ids=lambda s: s.value,
)
def test_a_sample_of_refused_transitions(current: JobState, target: JobState) -> None:
    assert not can_transition(current, target)
    with pytest.raises(IllegalTransition, match=f"from {current.value} to {target.value}"):
        check_transition(current, target)


@pytest.mark.parametrize(("current", "target"), REFUSED, ids=lambda s: s.value)
def test_everything_outside_the_table_is_refused(current: JobState, target: JobState) -> None:
    with pytest.raises(IllegalTransition):
        check_transition(current, target)


def test_terminal_states_are_final_and_the_rest_active() -> None:
    assert {S.succeeded, S.failed, S.cancelled, S.timeout} == TERMINAL_STATES
    assert all(is_terminal(s) for s in TERMINAL_STATES)
    assert not any(is_terminal(s) for s in ACTIVE_STATES)
    assert set(S) == ACTIVE_STATES | TERMINAL_STATES and not ACTIVE_STATES & TERMINAL_STATES
    assert all(ALLOWED_TRANSITIONS[s] == frozenset() for s in TERMINAL_STATES)
    # The service holds queued jobs, retries waiting their backoff and jobs waiting for their
    # dependencies (only the first two go to a backend); a backend holds the rest.
    assert {S.queued, S.retrying} == DISPATCHABLE_STATES
    assert not DISPATCHABLE_STATES & WATCHED_STATES
    assert ACTIVE_STATES - DISPATCHABLE_STATES - {S.waiting} == WATCHED_STATES


def test_every_active_state_can_be_cancelled_and_can_fail() -> None:
    for state in ACTIVE_STATES:
        assert can_transition(state, S.cancelled) and can_transition(state, S.failed), state


def test_a_requeue_and_a_retry_start_a_new_attempt() -> None:
    assert [s for s in S if starts_new_attempt(s)] == [S.requeued, S.retrying]


def test_states_are_plain_strings() -> None:
    assert S("running") is S.running and S.running == "running"


# ---------------------------------------------------------------- record_transition on a real ledger


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    migrate(engine)
    yield engine
    engine.dispose()


def new_job(session: Session) -> Job:
    job = Job(name="j", backend="local", spec={"entrypoint": "a.b:c"})
    session.add(job)
    session.flush()
    return job


def history(session: Session, job: Job) -> list[tuple[str | None, str, int, str | None]]:
    rows = session.exec(select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id))).all()
    return [(e.from_state and S(e.from_state).value, S(e.to_state).value, e.attempt, e.reason) for e in rows]


def test_record_transition_writes_the_state_event_and_timestamps(engine: Engine) -> None:
    with Session(engine) as session:
        job = new_job(session)
        assert record_transition(session, job, S.submitted, "local id 42", external_id="42")
        assert record_transition(session, job, S.running)
        started = job.started_at
        assert record_transition(session, job, S.failed, "NonZeroExitCode", exit_code=3)
        session.commit()

        assert S(job.state) is S.failed and job.reason == "NonZeroExitCode" and job.exit_code == 3
        assert job.submitted_at is not None and started is not None and job.finished_at is not None
        assert job.submitted_at <= started <= job.finished_at
        assert history(session, job) == [
            ("queued", "submitted", 1, "local id 42"),
            ("submitted", "running", 1, None),
            ("running", "failed", 1, "NonZeroExitCode"),
        ]


def test_requeued_adds_one_to_the_attempt_and_started_at_is_kept(engine: Engine) -> None:
    with Session(engine) as session:
        job = new_job(session)
        record_transition(session, job, S.submitted, external_id="7")
        record_transition(session, job, S.running)
        first_start = job.started_at
        record_transition(session, job, S.preempted, "PREEMPTED")
        record_transition(session, job, S.requeued, "REQUEUED")
        record_transition(session, job, S.running)

        assert job.attempt == 2
        assert job.started_at == first_start
        assert history(session, job)[-3:] == [
            ("running", "preempted", 1, "PREEMPTED"),
            ("preempted", "requeued", 2, "REQUEUED"),
            ("requeued", "running", 2, None),
        ]


def test_the_same_state_again_only_updates_the_reason(engine: Engine) -> None:
    with Session(engine) as session:
        job = new_job(session)
        record_transition(session, job, S.submitted, external_id="7")
        record_transition(session, job, S.pending, "Priority")

        assert record_transition(session, job, S.pending, "Resources") is S.pending
        assert record_transition(session, job, S.pending) is S.pending

        assert job.reason == "Resources"
        assert [to for _, to, _, _ in history(session, job)] == ["submitted", "pending"]


def test_a_refused_transition_changes_nothing(engine: Engine) -> None:
    with Session(engine) as session:
        job = new_job(session)
        record_transition(session, job, S.cancelled, "cancelled by user")

        with pytest.raises(IllegalTransition):
            record_transition(session, job, S.running)

        assert S(job.state) is S.cancelled and job.reason == "cancelled by user"
        assert len(history(session, job)) == 1


def test_a_cancel_requested_turns_any_ending_retry_or_submission_into_cancelled(engine: Engine) -> None:
    """The flag's one rule, in the door: no caller checks it before a move."""
    with Session(engine) as session:
        job = new_job(session)
        job.cancel_requested = True
        assert record_transition(session, job, S.submitted, "local id 7", external_id="7") is S.cancelled
        assert job.reason == "cancelled by user" and job.external_id == "7"  # the run to stop
        assert [to for _, to, _, _ in history(session, job)] == ["cancelled"]

        running = new_job(session)
        record_transition(session, running, S.submitted, external_id="8")
        record_transition(session, running, S.running)
        running.cancel_requested = True
        assert record_transition(session, running, S.failed, "rank 1 lost its peer") is S.cancelled
        assert running.finished_at is not None


def test_a_cancel_requested_gives_the_same_reason_whoever_ends_the_job(engine: Engine) -> None:
    """The scheduler's word of the cancel can reach the reconciler before the cancel's own last
    transaction: the user reads "cancelled by user" either way, not a timing-dependent "cancelled"."""
    with Session(engine) as session:
        job = new_job(session)
        record_transition(session, job, S.submitted, external_id="10")
        record_transition(session, job, S.running)
        job.cancel_requested = True
        assert record_transition(session, job, S.cancelled, "cancelled", kind="cancel") is S.cancelled
        assert job.reason == "cancelled by user"


def test_a_succeeded_job_stays_succeeded_whatever_was_asked(engine: Engine) -> None:
    with Session(engine) as session:
        job = new_job(session)
        record_transition(session, job, S.submitted, external_id="9")
        record_transition(session, job, S.running)
        job.cancel_requested = True  # asked as rank 0 wrote its result
        assert record_transition(session, job, S.succeeded, "completed") is S.succeeded
