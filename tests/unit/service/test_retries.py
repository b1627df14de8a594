"""How an attempt's end is classified (service.domain.endings) and what a retry policy makes of it
(service.domain.transitions.end_attempt), on a real ledger: the attempt rows, the backoff, the limits."""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.backends.base import BackendStatus
from service.domain.endings import Ending, from_rank_errors, rank_host, settle
from service.domain.transitions import end_attempt, record_transition
from service.jobfs import archive_attempt, rank_errors, read_result
from service.ledger.db import make_engine, migrate
from service.ledger.models.columns import utcnow
from service.ledger.models.history import JobAttempt, JobEvent
from service.ledger.models.jobs import Job, RetryPolicy
from service.states import JobState
from tests.fakes import FakeBackend
from worker.spec import ERROR_ATTEMPT_PREFIX, JobFiles, Resources

S = JobState
GLOO_LOST_PEER = (
    "Traceback (most recent call last):\n  ...\nRuntimeError: "
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:50313"
)
USER_ERROR = 'Traceback (most recent call last):\n  File "train.py", line 9\nValueError: bad learning rate'


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    migrate(engine)
    yield engine
    engine.dispose()


def running_job(session: Session, tmp_path: Path, policy: RetryPolicy | None, **resources: Any) -> Job:
    job = Job(
        name="j",
        backend="slurm",
        spec={"entrypoint": "a.b:c", "resources": {"nodes": 1, "tasks_per_node": 1, **resources}},
        retries=None if policy is None else policy.model_dump(mode="json"),
        folder=str(tmp_path / "job"),
        external_id="100",
        nodes="n[1-2]",
    )
    session.add(job)
    session.flush()
    record_transition(session, job, S.submitted, "slurm id 100", external_id="100")
    record_transition(session, job, S.running)
    return job


def write_error(tmp_path: Path, rank: int, text: str, age_s: float = 0) -> None:
    files = JobFiles(tmp_path / "job")
    files.folder.mkdir(parents=True, exist_ok=True)
    path = files.error(rank)
    path.write_text(text)
    written = path.stat().st_mtime - age_s
    os.utime(path, (written, written))


# ---------------------------------------------------------------- classification


@pytest.mark.parametrize(("resources", "world"), [({}, 1), ({"nodes": 2, "tasks_per_node": 4}, 8)])
def test_a_jobs_world_size_is_the_one_its_ranks_get(resources: dict[str, int], world: int) -> None:
    job = Job(name="w", backend="local", spec={"resources": resources})
    assert job.resources.world_size == Resources(**resources).world_size == world


def test_a_rank_that_raised_on_its_own_is_the_jobs_failure_whatever_its_peers_said(
    engine: Engine, tmp_path: Path
) -> None:
    write_error(tmp_path, 1, USER_ERROR, age_s=2)  # first: the cause
    write_error(tmp_path, 0, GLOO_LOST_PEER)  # then rank 0, which lost rank 1
    with Session(engine) as session:
        job = running_job(session, tmp_path, None, nodes=2, tasks_per_node=1)
        errors = rank_errors(JobFiles(tmp_path / "job"), None, job.resources.world_size)
        ending = from_rank_errors(job, errors)

    assert ending.kind == "failure" and ending.state is S.failed
    assert ending.reason.startswith("rank 1 on n2 raised:\n")
    assert "ValueError: bad learning rate" in ending.reason
    assert ending.reason.endswith("(ranks 0 failed after it)")


def test_ranks_that_only_lost_a_peer_mean_the_silent_rank_vanished(engine: Engine, tmp_path: Path) -> None:
    for rank in (0, 1, 3):  # rank 2 was SIGKILLed: it wrote nothing
        write_error(tmp_path, rank, GLOO_LOST_PEER, age_s=3 - rank)
    with Session(engine) as session:
        job = running_job(session, tmp_path, None, nodes=2, tasks_per_node=2)
        errors = rank_errors(JobFiles(tmp_path / "job"), None, job.resources.world_size)
        ending = from_rank_errors(job, errors)

    assert ending.kind == "node_failure"
    assert ending.reason.startswith("rank 2 on n2 vanished (rank 0 on n1 lost it):\n")


@pytest.mark.parametrize(
    ("status", "kind", "state", "says"),
    [
        (
            BackendStatus(S.failed, "node failure", kind="node_failure"),
            "node_failure",
            S.failed,
            "node failure (nodes n[1-2])",
        ),
        (BackendStatus(S.failed, "out of memory", kind="oom"), "oom", S.failed, "out of memory"),
        (
            BackendStatus(S.failed, "preempted, not requeued", kind="preemption"),
            "preemption",
            S.failed,
            "preempted, not requeued",
        ),
        (BackendStatus(S.failed, None, exit_code=137), "oom", S.failed, "out of memory, most likely"),
        (BackendStatus(S.timeout, None), "timeout", S.timeout, "exceeded its time limit"),
        (BackendStatus(S.cancelled, "cancelled by uid 0"), "cancel", S.cancelled, "cancelled by uid 0"),
        (BackendStatus(S.failed, None, exit_code=1), "failure", S.failed, "failed"),
        (
            BackendStatus(
                S.failed,
                "node n1, the batch host, was lost: SLURM ends the allocation",
                kind="node_failure",
                lost_batch_host="n1",
            ),
            "node_failure",
            S.failed,
            "node n1, the batch host, was lost",
        ),
    ],
)
def test_the_schedulers_word_when_no_rank_wrote_one(
    engine: Engine, tmp_path: Path, status: BackendStatus, kind: str, state: JobState, says: str
) -> None:
    with Session(engine) as session:
        job = running_job(session, tmp_path, None)
        ending = settle(job, JobFiles(tmp_path / "job"), status, FakeBackend("slurm"))

    assert (ending.kind, ending.state) == (kind, state)
    assert says in ending.reason


def test_a_lost_batch_host_is_the_cause_whatever_the_other_ranks_wrote(
    engine: Engine, tmp_path: Path
) -> None:
    """Rank 1 on n2 saw rank 0 go before SLURM killed it too; the cause is n1, the batch host, whose
    loss ended the allocation, and `retries` requeues it (node_failure) with that node named."""
    write_error(tmp_path, 1, GLOO_LOST_PEER)
    lost = "node n1, the batch host, was lost: SLURM ends the allocation with it; signal 9 (SIGKILL)"
    status = BackendStatus(S.failed, lost, nodes="n2", kind="node_failure", lost_batch_host="n1")
    with Session(engine) as session:
        job = running_job(session, tmp_path, RetryPolicy(), nodes=2)
        ending = settle(job, JobFiles(tmp_path / "job"), status, FakeBackend("slurm"))
        assert (ending.state, ending.kind, ending.reason) == (S.failed, "node_failure", lost)
        end_attempt(session, job, ending)
        assert S(job.state) is S.retrying and "retry 1 of 2" in (job.reason or "")


def test_ranks_fill_the_nodes_in_order(engine: Engine, tmp_path: Path) -> None:
    with Session(engine) as session:
        job = running_job(session, tmp_path, None, nodes=2, tasks_per_node=3)
        assert [rank_host(job, rank) for rank in range(6)] == ["n1", "n1", "n1", "n2", "n2", "n2"]


# ---------------------------------------------------------------- the policy


def attempts(session: Session, job: Job) -> list[tuple[int, str, str | None, str | None]]:
    rows = session.exec(
        select(JobAttempt).where(JobAttempt.job_id == job.id).order_by(col(JobAttempt.attempt))
    )
    return [(row.attempt, S(row.state).value, row.kind, row.external_id) for row in rows]


def test_a_covered_ending_becomes_a_retry_after_the_backoff(engine: Engine, tmp_path: Path) -> None:
    policy = RetryPolicy(max=2, backoff_s=30, backoff_factor=2, on=["failure"])
    with Session(engine) as session:
        job = running_job(session, tmp_path, policy)
        before = utcnow()
        end_attempt(session, job, Ending(S.failed, "failure", "rank 0 raised: boom"), exit_code=1)

        assert S(job.state) is S.retrying and job.attempt == 2
        assert job.external_id is None  # the next attempt gets a new one
        assert job.retry_at is not None
        assert before + timedelta(seconds=30) <= job.retry_at <= utcnow() + timedelta(seconds=30)
        assert attempts(session, job) == [(1, "failed", "failure", "100")]
        event = session.exec(
            select(JobEvent).where(JobEvent.job_id == job.id).order_by(col(JobEvent.id).desc())
        ).first()
        assert event is not None and event.to_state == S.retrying and event.attempt == 2
        assert event.reason is not None and "rank 0 raised: boom" in event.reason
        assert "retry 1 of 2: attempt 2 in 30 s" in event.reason
        row = session.exec(select(JobAttempt).where(JobAttempt.job_id == job.id)).one()
        assert row.reason == "rank 0 raised: boom"  # the ending's own words, without the retry's

        # Attempt 2 goes out and fails the same way: the wait doubles.
        record_transition(session, job, S.submitted, "slurm id 101", external_id="101")
        job.external_id = "101"
        record_transition(session, job, S.running)
        end_attempt(session, job, Ending(S.failed, "failure", "again"))
        assert S(job.state) is S.retrying and job.attempt == 3
        assert job.reason is not None and "retry 2 of 2: attempt 3 in 60 s" in job.reason

        # Attempt 3 is the last one the policy allows: it ends the job, every attempt listed.
        record_transition(session, job, S.submitted, "slurm id 102", external_id="102")
        job.external_id = "102"
        end_attempt(session, job, Ending(S.failed, "failure", "and again"))
        assert S(job.state) is S.failed and job.reason == "and again"
        assert attempts(session, job) == [
            (1, "failed", "failure", "100"),
            (2, "failed", "failure", "101"),
            (3, "failed", "failure", "102"),
        ]


@pytest.mark.parametrize(
    ("policy", "ending"),
    [
        (None, Ending(S.failed, "node_failure", "rank 1 vanished")),  # a job older than policies
        (RetryPolicy(max=0), Ending(S.failed, "node_failure", "rank 1 vanished")),
        (RetryPolicy(), Ending(S.failed, "failure", "rank 0 raised")),  # the default leaves the user's own
        (RetryPolicy(on=["failure"]), Ending(S.timeout, "timeout", "exceeded its time limit")),
        (RetryPolicy(on=["failure"]), Ending(S.cancelled, "cancel", "cancelled by uid 0")),
        (RetryPolicy(), Ending(S.succeeded, None, "completed", {"loss": 0.1})),
    ],
)
def test_an_ending_the_policy_does_not_cover_ends_the_job(
    engine: Engine, tmp_path: Path, policy: RetryPolicy | None, ending: Ending
) -> None:
    with Session(engine) as session:
        job = running_job(session, tmp_path, policy)
        end_attempt(session, job, ending)

        assert S(job.state) is ending.state and job.attempt == 1
        assert attempts(session, job) == [(1, ending.state.value, ending.kind, "100")]
        assert job.result == ending.result


def test_the_default_policy_retries_a_node_failure_twice(engine: Engine, tmp_path: Path) -> None:
    with Session(engine) as session:
        job = running_job(session, tmp_path, RetryPolicy())
        end_attempt(session, job, Ending(S.failed, "node_failure", "rank 1 on n2 vanished"))
        assert S(job.state) is S.retrying and job.reason is not None
        assert "retry 1 of 2: attempt 2 in 30 s" in job.reason


def test_a_job_its_user_asked_to_cancel_ends_cancelled_whatever_its_ranks_said(
    engine: Engine, tmp_path: Path
) -> None:
    with Session(engine) as session:
        job = running_job(session, tmp_path, RetryPolicy())
        job.cancel_requested = True
        end_attempt(session, job, Ending(S.failed, "node_failure", "rank 1 vanished"))
        assert S(job.state) is S.cancelled and job.attempt == 1
        assert attempts(session, job) == [(1, "cancelled", "cancel", "100")]


def test_requeues_do_not_use_up_the_retries(engine: Engine, tmp_path: Path) -> None:
    with Session(engine) as session:
        job = running_job(session, tmp_path, RetryPolicy(max=1, backoff_s=10))
        record_transition(session, job, S.preempted, "PREEMPTED")
        record_transition(session, job, S.requeued, "requeued (restart 1)")  # SLURM's, attempt 2
        record_transition(session, job, S.running)
        end_attempt(session, job, Ending(S.failed, "node_failure", "rank 1 vanished"))

        assert S(job.state) is S.retrying and job.attempt == 3
        assert job.reason is not None and "retry 1 of 1: attempt 3 in 10 s" in job.reason


def test_a_lost_peer_in_a_job_of_one_rank_is_its_own_failure(engine: Engine, tmp_path: Path) -> None:
    write_error(tmp_path, 0, GLOO_LOST_PEER)  # its own connection to some server broke
    with Session(engine) as session:
        job = running_job(session, tmp_path, None, nodes=1, tasks_per_node=1)
        errors = rank_errors(JobFiles(tmp_path / "job"), None, job.resources.world_size)
        assert from_rank_errors(job, errors).kind == "failure"


def test_files_of_an_earlier_attempt_are_not_this_ones(engine: Engine, tmp_path: Path) -> None:
    files = JobFiles(tmp_path / "job")
    write_error(tmp_path, 0, f"{ERROR_ATTEMPT_PREFIX}1\n{USER_ERROR}")
    files.result.write_text('{"attempt": 1, "value": {"loss": 0.5}}')
    assert rank_errors(files, 2, 2) == [] and read_result(files, 2) is None  # attempt 2 runs now
    assert len(rank_errors(files, 1, 2)) == 1 and read_result(files, 1) == {
        "attempt": 1,
        "value": {"loss": 0.5},
    }


@pytest.mark.parametrize("kind", ["link", "fifo", "folder"])
def test_a_job_file_that_is_not_a_regular_file_is_not_read(tmp_path: Path, kind: str) -> None:
    secret = tmp_path / "secret.env"
    secret.write_text('{"attempt": 1, "value": "TORCHYARD_DATABASE_URL=postgresql://..."}')
    files = JobFiles(tmp_path / "job")
    files.folder.mkdir()
    if kind == "link":
        files.result.symlink_to(secret)
        files.error(0).symlink_to(secret)
    elif kind == "fifo":
        os.mkfifo(files.result)  # open() without O_NONBLOCK would wait for a writer for ever
        os.mkfifo(files.error(0))
    else:
        files.result.mkdir()
        files.error(0).mkdir()

    assert read_result(files, None) is None
    assert rank_errors(files, None, 2) == []


# ---------------------------------------------------------------- what a retry moves aside


def test_archiving_moves_the_attempts_files_once_and_keeps_the_new_attempts_own(tmp_path: Path) -> None:
    files = JobFiles(tmp_path / "job")
    files.submitit.mkdir(parents=True)
    (files.submitit / "100_submitted.pkl").write_bytes(b"attempt 1")
    write_error(tmp_path, 0, USER_ERROR)

    archive_attempt(files, 1, 1)
    files.submitit.mkdir()  # the dispatcher makes attempt 2's, and its sbatch is refused ...
    (files.submitit / ".staged-x-0.pkl").write_bytes(b"attempt 2")
    archive_attempt(files, 1, 1)  # ... so the job is dispatched again

    archive = files.folder / "attempts" / "1"
    assert (archive / "submitit" / "100_submitted.pkl").read_bytes() == b"attempt 1"
    assert (archive / "error-rank0.txt").exists() and not list(files.folder.glob("error-rank*.txt"))
    assert (files.submitit / ".staged-x-0.pkl").read_bytes() == b"attempt 2"  # left where it is
    assert archive.stat().st_uid == os.geteuid()


def test_archiving_follows_no_link_the_job_planted(tmp_path: Path) -> None:
    victim = tmp_path / "another-users-job"
    victim.mkdir()
    files = JobFiles(tmp_path / "job")
    files.folder.mkdir()
    (files.folder / "submitit").symlink_to(victim)  # moved as a link, the target untouched
    archive_attempt(files, 1, 1)
    assert (files.folder / "attempts" / "1" / "submitit").is_symlink() and list(victim.iterdir()) == []

    (files.folder / "attempts").rename(files.folder / "moved")
    (files.folder / "attempts").symlink_to(victim)  # where the archive would be made
    with pytest.raises(OSError):
        archive_attempt(files, 2, 1)
    assert list(victim.iterdir()) == []
