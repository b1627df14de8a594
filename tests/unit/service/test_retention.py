"""Retention on a real ledger and a real data directory: finished, running, queued, retrying and requeued
jobs, folders the jobs filled with links, unreadable and very deep folders and files of other accounts.
Only what the rule says goes, the ledger keeps every row, and a pass cut short at any point is finished
by the next one, with no half-deleted folder ever at a job's name.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from service import jobfs
from service.backends import slurm_submit
from service.bulkhead import Bulkhead
from service.config import Settings
from service.domain import retention
from service.domain.storage import prepare_data_dir
from service.jobfs import folders, jobs_root
from service.ledger import name_index
from service.ledger.models.access import UserQuota
from service.ledger.models.columns import utcnow
from service.ledger.models.history import JobEvent
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric
from service.loops.housekeeping import Housekeeper
from service.states import JobState

DAY = timedelta(days=1)
OUTSIDE = "the service's own file, which a job's link points at"


@pytest.fixture
def data(settings: Settings, engine: Engine, tmp_path: Path) -> Settings:
    settings = settings.model_copy(update={"keep_finished_days": 7.0, "keep_logs_days": 30.0})
    prepare_data_dir(settings)
    (tmp_path / "outside.txt").write_text(OUTSIDE)
    return settings


def add_job(engine: Engine, settings: Settings, state: JobState, ended_days_ago: float | None = None,
            owner: str = "alice") -> Job:  # fmt: skip
    with Session(engine) as session:
        job = Job(name=f"{state.value}-{ended_days_ago}", owner=owner, backend="local", state=state)
        if ended_days_ago is not None:
            job.finished_at = utcnow() - timedelta(days=ended_days_ago)
        session.add(job)
        session.commit()
        job.folder = str(jobs_root(settings) / str(job.id))
        session.add(job)
        assert job.id is not None
        session.add(JobEvent(job_id=job.id, to_state=state))
        session.add(JobMetric(job_id=job.id, step=1, name="loss", value=0.5))
        session.commit()
        session.refresh(job)
    fill_folder(Path(job.folder or ""), outside=settings.data_dir.parent / "outside.txt")
    return job


def fill_folder(folder: Path, outside: Path) -> None:
    """What a job leaves: checkpoints, logs of two attempts, a link out, an unreadable folder, a deep
    tree, a file of another account."""
    (folder / "checkpoints").mkdir(parents=True)
    (folder / "checkpoints" / "ckpt-00000001.pt").write_bytes(os.urandom(64 * 1024))
    (folder / "submitit").mkdir()
    (folder / "submitit" / "42_0_log.out").write_text("rank 0 says hello\n")
    (folder / "submitit" / "42_0_log.err").write_text("rank 0 warns\n")
    (folder / "submitit" / "42_submitted.pkl").write_bytes(b"pickle")
    (folder / "attempts" / "1" / "submitit").mkdir(parents=True)
    (folder / "attempts" / "1" / "submitit" / "41_0_log.out").write_text("attempt 1\n")
    (folder / "attempts" / "1" / "error-rank0.txt").write_text("attempt: 1\nboom")
    (folder / "link-out").symlink_to(outside)
    (folder / "checkpoints" / "ckpt-00000002.pt").symlink_to(outside)
    (folder / "submitit" / "7_0_log.out").symlink_to(outside)  # a "log" that is a link: not kept
    locked = folder / "locked"
    (locked / "inner").mkdir(parents=True)
    (locked / "inner" / "data").write_text("x" * 5000)
    locked.chmod(0)
    deep = folder / "deep"
    deep.mkdir()
    for _ in range(folders.MAX_DEPTH + 30):
        deep = deep / "d"
        deep.mkdir()
    (deep / "bottom").write_text("deep down")
    foreign = folder / "foreign"
    foreign.write_text("written by the job's own account")
    os.chown(foreign, 65534, 65534)  # nobody: the service (root) still removes it


def names(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")} if folder.exists() else set()


LOGS = {"submitit", "submitit/42_0_log.out", "submitit/42_0_log.err", "attempts", "attempts/1",
        "attempts/1/submitit", "attempts/1/submitit/41_0_log.out"}  # fmt: skip


def ledger_rows(engine: Engine) -> tuple[int, int, int]:
    with Session(engine) as session:
        return tuple(len(session.exec(select(model)).all()) for model in (Job, JobEvent, JobMetric))  # type: ignore[return-value]


def job_row(engine: Engine, job_id: int | None) -> Job:
    with Session(engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def test_only_what_the_rule_says_goes(data: Settings, engine: Engine, tmp_path: Path) -> None:
    old = add_job(engine, data, JobState.succeeded, ended_days_ago=40)  # past both: the whole folder
    ended = add_job(engine, data, JobState.failed, ended_days_ago=10)  # past 7 days: all but its logs
    recent = add_job(engine, data, JobState.cancelled, ended_days_ago=2)  # kept
    untouched = [
        add_job(engine, data, JobState.running),
        add_job(engine, data, JobState.queued),
        add_job(engine, data, JobState.retrying),  # its next attempt resumes from this folder
        add_job(engine, data, JobState.requeued),
    ]
    rows = ledger_rows(engine)
    before = {job.id: names(Path(job.folder or "")) for job in [recent, *untouched]}

    planned = retention.run_pass(engine, data, dry_run=True)
    assert [(r.job_id, r.removing) for r in planned.removals] == [(old.id, "folder"), (ended.id, "files")]
    assert all(r.bytes > 64 * 1024 for r in planned.removals) and planned.freed == 0
    assert Path(old.folder or "").exists(), "a dry run removes nothing"

    report = retention.run_pass(engine, data)

    assert [(r.job_id, r.removing) for r in report.removals] == [(old.id, "folder"), (ended.id, "files")]
    assert report.freed >= sum(r.bytes for r in planned.removals) - 64 * 1024
    assert not Path(old.folder or "").exists()
    assert names(Path(ended.folder or "")) == LOGS
    for job in [recent, *untouched]:
        assert names(Path(job.folder or "")) == before[job.id], job.state
    assert (tmp_path / "outside.txt").read_text() == OUTSIDE, "no link was followed"
    assert os.listdir(jobs_root(data) / jobfs.TRASH) == []
    assert ledger_rows(engine) == rows, "the ledger keeps every job, event and metric"
    gone, emptied = job_row(engine, old.id), job_row(engine, ended.id)
    assert gone.folder_removed_at is not None and gone.folder_bytes == 0
    assert emptied.files_removed_at is not None and emptied.folder_removed_at is None
    assert emptied.folder_bytes is not None and 0 < emptied.folder_bytes < 64 * 1024

    again = retention.run_pass(engine, data)
    assert again.removals == [] and again.freed == 0


def test_a_users_own_keep_time_and_for_ever(data: Settings, engine: Engine) -> None:
    alice = add_job(engine, data, JobState.succeeded, ended_days_ago=3, owner="alice")
    bob = add_job(engine, data, JobState.succeeded, ended_days_ago=3, owner="bob")
    carol = add_job(engine, data, JobState.succeeded, ended_days_ago=100, owner="carol")
    with Session(engine) as session:
        session.add(UserQuota(username="alice", keep_finished_days=1.0))
        session.add(UserQuota(username="carol", keep_finished_days=0))  # for ever
        session.commit()

    report = retention.run_pass(engine, data)

    assert [(r.job_id, r.removing) for r in report.removals] == [(alice.id, "files")]
    assert names(Path(alice.folder or "")) == LOGS
    assert "checkpoints" in names(Path(bob.folder or "")) and "checkpoints" in names(Path(carol.folder or ""))
    assert retention.keep_days(data) == retention.KeepDays(7.0, 30.0)
    assert retention.keep_days(data, 45.0) == retention.KeepDays(45.0, 45.0)  # logs never go first
    assert retention.keep_days(data, 0) == retention.KeepDays(None, None)
    same = data.model_copy(update={"keep_logs_days": None})
    assert retention.keep_days(same) == retention.KeepDays(7.0, 7.0)


class Crash(BaseException):
    """The service dying at this point (no Exception: no bulkhead of a loop catches a kill)."""


def crash_on(monkeypatch: pytest.MonkeyPatch, target: object, name: str, after: int,
             counts: Callable[..., bool] = lambda *args: True) -> None:  # fmt: skip
    """`target.name` raises Crash once it has been called `after` times (calls `counts` accepts)."""
    real: Callable[..., object] = getattr(target, name)
    calls = iter(range(1 << 30))

    def dying(*args: object, **kwargs: object) -> object:
        if counts(*args) and next(calls) >= after:
            raise Crash(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, dying)


def test_a_pass_cut_short_anywhere_is_finished_by_the_next(
    data: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    whole = add_job(engine, data, JobState.succeeded, ended_days_ago=40)
    files = add_job(engine, data, JobState.succeeded, ended_days_ago=10)
    folder, full = Path(whole.folder or ""), names(Path(files.folder or ""))

    # 1. dies after moving the folder into the trash, before the ledger says so
    with monkeypatch.context() as patch:
        crash_on(patch, retention, "write_scope", after=0)
        with pytest.raises(Crash):
            retention.run_pass(engine, data)
    assert not folder.exists(), "at its name: whole or gone, never half"
    assert job_row(engine, whole.id).folder_removed_at is None
    # 2. dies half-way through deleting the trash (after a few files)
    with monkeypatch.context() as patch:
        crash_on(patch, os, "unlink", after=3)
        with pytest.raises(Crash):
            retention.run_pass(engine, data)
    # 3. dies half-way through moving the other job's files out (after two entries)
    with monkeypatch.context() as patch:
        crash_on(patch, os, "rename", after=2, counts=lambda src, dst, *_: dst.isdigit())
        with pytest.raises(Crash):
            retention.run_pass(engine, data)
    assert os.listdir(jobs_root(data) / jobfs.TRASH), "the trash holds what is half-deleted"
    assert LOGS < names(Path(files.folder or "")) < full, "each entry moved whole, or not yet"

    retention.run_pass(engine, data)  # the restarted service's first pass

    assert job_row(engine, whole.id).folder_removed_at is not None
    assert job_row(engine, files.id).files_removed_at is not None
    assert names(Path(files.folder or "")) == LOGS
    assert os.listdir(jobs_root(data) / jobfs.TRASH) == []
    assert (tmp_path / "outside.txt").read_text() == OUTSIDE


def test_folder_sizes_are_measured_when_jobs_end_and_for_running_jobs(data: Settings, engine: Engine) -> None:
    running = add_job(engine, data, JobState.running)
    ended = add_job(engine, data, JobState.succeeded, ended_days_ago=0)

    assert retention.measure_ended(engine, data) == 1
    assert retention.measure_ended(engine, data) == 0, "measured once"
    assert job_row(engine, running.id).folder_bytes is None
    size = job_row(engine, ended.id).folder_bytes
    assert size is not None and size > 64 * 1024
    usage = jobfs.usage(Path(ended.folder or ""))
    assert usage is not None and usage.total == size and 0 < usage.logs < 64 * 1024

    assert retention.measure_unfinished(engine, data) == 1
    measured = job_row(engine, running.id)
    assert measured.folder_bytes == size and measured.folder_measured_at is not None


def test_an_array_folder_goes_once_every_job_it_links_to_has_ended(data: Settings, engine: Engine) -> None:
    ended = add_job(engine, data, JobState.succeeded, ended_days_ago=0.1)
    failed = add_job(engine, data, JobState.failed, ended_days_ago=0.1)
    running = add_job(engine, data, JobState.running)
    arrays = slurm_submit.arrays_dir(data.data_dir)

    def array_of(*jobs: Path, age_s: float = retention.ARRAY_FOLDER_GRACE_S + 60) -> Path:
        root = slurm_submit.array_root(arrays)
        slurm_submit.link_array_folders(root, [job / "submitit" for job in jobs])
        (root / "12_submission.sh").write_text("#!/bin/bash\n")
        made = time.time() - age_s
        os.utime(root, (made, made))
        return root

    def folder(job: Job) -> Path:
        return Path(job.folder or "")

    all_ended = array_of(folder(ended), folder(failed))
    one_running = array_of(folder(ended), folder(running))
    young = array_of(folder(ended), age_s=10)  # its links may still be being made
    of_deleted_jobs = array_of(jobs_root(data) / "999999")  # a job gone from the ledger
    Housekeeper(engine, data).run_pass()
    assert not all_ended.exists() and not of_deleted_jobs.exists()
    assert one_running.is_dir() and young.is_dir()
    # the links went, not what they lead to
    assert (folder(ended) / "submitit" / "42_0_log.out").read_text() == "rank 0 says hello\n"
    assert (folder(failed) / "submitit" / "42_0_log.out").is_file()

    with Session(engine) as session:
        job = session.get(Job, running.id)
        assert job is not None
        job.state, job.finished_at = JobState.cancelled, utcnow()
        session.add(job)
        session.commit()
    assert retention.prune_array_folders(engine, data) == 1
    assert not one_running.exists() and young.is_dir()
    assert sorted(path.name for path in arrays.iterdir()) == [young.name]


def test_a_pass_leaves_the_name_index_in_one_piece(data: Settings, engine: Engine) -> None:
    for _ in range(12):  # a write transaction each: a segment each in SQLite's index
        add_job(engine, data, JobState.queued)
    Housekeeper(engine, data).run_pass()
    assert name_index.merge_segments(engine) == 0


def test_a_folder_that_breaks_the_pass_costs_that_job_only(
    data: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bulkhead: an error nothing expects, on one job's folder, leaves it for the next pass, and
    the pass goes on with the others (before, the first such folder stopped every pass there)."""
    broken = add_job(engine, data, JobState.succeeded, ended_days_ago=40)
    fine = add_job(engine, data, JobState.succeeded, ended_days_ago=40)
    real = jobfs.usage

    def usage(folder: Path | None) -> object:
        if folder == Path(broken.folder or ""):
            raise RuntimeError("nothing expects this")
        return real(folder)

    monkeypatch.setattr(jobfs, "usage", usage)
    guard = Bulkhead(retention.RETENTION)
    report = retention.run_pass(engine, data, guard=guard)

    assert [removal.job_id for removal in report.removals] == [fine.id]
    assert job_row(engine, fine.id).folder_removed_at is not None
    assert job_row(engine, broken.id).folder_removed_at is None and Path(broken.folder or "").exists()
    assert guard.faults_total == 1
