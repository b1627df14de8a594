"""Retention: which finished jobs' folders go and when, doing it, and measuring the folders.

The ledger keeps every job, event and metric; only the files go. A finished job's folder loses all but
its logs `keep_finished_days` after the job ended (the owner's own value where the operator set one,
`torchyard quota set --keep-finished-days`), and the logs go `keep_logs_days` after it ended (never
sooner than the rest). 0 keeps them for ever. Only jobs in a terminal state are looked at: nothing of a
queued, running, retrying or requeued job (its folder holds what the next attempt resumes from) is
touched. The removal itself is service.jobfs.folders (rename into the trash, then delete).

Folder sizes are measured here too, off the request path: when a job has ended (its size is unknown
again from then) and, for unfinished jobs, at every retention pass. /metrics and the API read the
stored numbers.
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal

from sqlalchemy import Select, func, select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from service import jobfs
from service.backends import slurm_submit
from service.bulkhead import Bulkhead, Fault
from service.config import Settings
from service.jobfs import jobs_root
from service.ledger.db import session_scope, write_scope
from service.ledger.models.access import UserQuota
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.sql import id_conditions
from service.states import ACTIVE_STATES, TERMINAL_STATES

log = logging.getLogger(__name__)

Removing = Literal["files", "folder"]  # everything but the logs; the whole folder
TERMINAL = [state.value for state in TERMINAL_STATES]
ACTIVE = [state.value for state in ACTIVE_STATES]
RETENTION = "retention"  # the bulkhead's step, in a fault's reason and /metrics
MEASURE_BATCH = 200  # ended jobs measured per tick; more wait for the next
ARRAY_FOLDER_GRACE_S = 3600.0  # an array folder younger than this is left: its links may be under way


@dataclass(frozen=True)
class KeepDays:
    """How long after a job ended its files and its logs stay; None: for ever."""

    files: float | None
    logs: float | None


def keep_days(settings: Settings, override: float | None = None) -> KeepDays:
    """The rule for one owner: their own keep_finished_days where set, else the service's."""
    chosen = settings.keep_finished_days if override is None else override
    files = None if chosen == 0 else chosen
    if settings.keep_logs_days is None:
        return KeepDays(files, files)
    if settings.keep_logs_days == 0 or files is None:
        return KeepDays(files, None)
    return KeepDays(files, max(settings.keep_logs_days, files))


@dataclass(frozen=True)
class Removal:
    job_id: int
    owner: str
    removing: Removing
    folder: Path
    finished_at: datetime
    bytes: int = 0  # what it frees, as measured before the removal


@dataclass
class PassReport:
    removals: list[Removal] = field(default_factory=list)
    freed: int = 0  # bytes the trash gave back (0 for a dry run)


def due_removals(session: Session, settings: Settings, now: datetime) -> list[Removal]:
    """What the rules remove now, oldest ending first."""
    overrides = _overrides(session)
    rules = [keep_days(settings), *(keep_days(settings, days) for days in overrides.values())]
    shortest = min((rule.files for rule in rules if rule.files is not None), default=None)
    if shortest is None:
        return []
    query = (
        select(col(Job.id), col(Job.owner), col(Job.folder), col(Job.finished_at), col(Job.files_removed_at))
        .where(
            col(Job.folder_removed_at).is_(None),
            col(Job.finished_at) <= now - timedelta(days=shortest),
            col(Job.state).in_(TERMINAL),
        )
        .order_by(col(Job.finished_at))
    )
    due = []
    for job_id, owner, folder, finished_at, files_removed_at in session.execute(query):
        rule = keep_days(settings, overrides.get(owner))
        age = now - finished_at
        removing: Removing | None = None
        if rule.logs is not None and age >= timedelta(days=rule.logs):
            removing = "folder"
        elif rule.files is not None and age >= timedelta(days=rule.files) and files_removed_at is None:
            removing = "files"
        place = _own_folder(settings, job_id, folder)
        if removing is not None and place is not None:
            due.append(Removal(job_id, owner, removing, place, finished_at))
    return due


def run_pass(
    engine: Engine, settings: Settings, *, dry_run: bool = False, guard: Bulkhead | None = None
) -> PassReport:
    """One retention pass. A dry run measures what would go and changes nothing. Each job's part is
    in `guard` (a bulkhead): what goes wrong with one job's folder leaves it for the next pass, and
    the pass goes on with the others."""
    guard = guard or Bulkhead(RETENTION)
    report = PassReport()
    root = jobs_root(settings)
    if not dry_run:
        report.freed += jobfs.empty_trash(root)  # what a pass that died half-way left
        measure_unfinished(engine, settings, guard)
    with session_scope(engine) as session:
        due = due_removals(session, settings, utcnow())
    for removal in due:
        done = guard.guarded(
            removal.job_id, functools.partial(_measured_and_removed, engine, removal, dry_run)
        )
        if isinstance(done, Fault):  # this folder only (a file it cannot move yet): the next pass retries
            continue
        report.removals.append(done)
        if not dry_run:
            report.freed += jobfs.empty_trash(root)  # room comes back job by job, not at the end
    return report


def _measured_and_removed(engine: Engine, removal: Removal, dry_run: bool) -> Removal:
    found = jobfs.usage(removal.folder)
    if found is not None:
        removal = replace(removal, bytes=found.total - (found.logs if removal.removing == "files" else 0))
    if not dry_run:
        _remove(engine, removal)
    return removal


def _remove(engine: Engine, removal: Removal) -> None:
    """Move it into the trash, then say so in the ledger; the trash is emptied after. A service that
    dies in between finds the job due again and its folder gone or emptied: it only writes the row."""
    if removal.removing == "folder":
        jobfs.move_folder_to_trash(removal.folder)
    else:
        jobfs.move_files_to_trash(removal.folder)
    left = jobfs.usage(removal.folder)
    with write_scope(engine) as session:
        job = session.get(Job, removal.job_id)
        if job is None:
            return
        now = utcnow()
        job.files_removed_at = job.files_removed_at or now
        if removal.removing == "folder" or left is None:
            job.folder_removed_at = now
        job.folder_bytes, job.folder_measured_at = (left.total if left else 0), now
        session.add(job)
    log.info(
        "retention: removed the %s of job %d (%d bytes)", removal.removing, removal.job_id, removal.bytes
    )


def measure_ended(engine: Engine, settings: Settings, guard: Bulkhead | None = None) -> int:
    """Measure the folders of jobs that ended since their last measurement. Returns how many."""
    query = (
        select(col(Job.id), col(Job.folder))
        .where(
            col(Job.folder_bytes).is_(None),
            col(Job.folder_removed_at).is_(None),
            col(Job.state).in_(TERMINAL),
        )
        .limit(MEASURE_BATCH)
    )
    return _measure(engine, settings, query, TERMINAL, guard or Bulkhead(RETENTION), missing_is_empty=True)


def measure_unfinished(engine: Engine, settings: Settings, guard: Bulkhead | None = None) -> int:
    """Measure the folders of every unfinished job (they grow as the jobs run)."""
    query = select(col(Job.id), col(Job.folder)).where(col(Job.state).in_(ACTIVE))
    return _measure(engine, settings, query, ACTIVE, guard or Bulkhead(RETENTION), missing_is_empty=False)


def _measure(
    engine: Engine,
    settings: Settings,
    query: Select[int | None, str | None],
    states: list[str],
    guard: Bulkhead,
    *,
    missing_is_empty: bool,
) -> int:
    """Measure the folders of the jobs `query` selects (id, folder) and store the sizes of those still
    in `states` (a running job that ended meanwhile is measured again as an ended one)."""
    with session_scope(engine) as session:
        rows = session.execute(query).all()
    sizes: dict[int, int] = {}
    for job_id, folder in rows:
        place = _own_folder(settings, job_id, folder)
        found = guard.guarded(job_id, functools.partial(jobfs.usage, place)) if place is not None else None
        if isinstance(found, Fault):
            continue
        if found is not None or missing_is_empty:
            sizes[job_id] = found.total if found is not None else 0
    if not sizes:
        return 0
    with write_scope(engine) as session:  # measured first, written after: no lock held while walking
        now = utcnow()
        for job_id, size in sizes.items():
            job = session.get(Job, job_id)
            if job is None or job.state not in states or job.folder_removed_at is not None:
                continue
            # Never over what retention wrote; and only a size that changed is written: a write restamps
            # the job, which makes every reader render it again and wakes its long polls.
            if (job.state in ACTIVE or job.folder_bytes is None) and size != job.folder_bytes:
                job.folder_bytes, job.folder_measured_at = size, now
                session.add(job)
    return len(sizes)


ON_DISK = (col(Job.folder_removed_at).is_(None), col(Job.folder_bytes).is_not(None))  # and measured
MAX_LARGEST = 1000


@dataclass(frozen=True)
class FolderTotals:
    """The job folders still on disk, as last measured, together: what /metrics shows. Any token may
    read /metrics, so it names no job (a job's id and size would tell who runs what, and how big)."""

    count: int
    bytes: int
    largest: int


def folder_totals(session: Session) -> FolderTotals:
    size = col(Job.folder_bytes)
    query = select(func.count(), func.coalesce(func.sum(size), 0), func.coalesce(func.max(size), 0))
    count, total, largest = session.execute(query.where(*ON_DISK)).one()
    return FolderTotals(int(count), int(total), int(largest))


def largest_folders(session: Session, limit: int) -> list[Job]:
    """The `limit` largest job folders still on disk, as last measured, largest first: for an admin
    looking for what fills the disk (the index on folder_bytes answers it)."""
    query = select(Job).where(*ON_DISK).order_by(col(Job.folder_bytes).desc(), col(Job.id)).limit(limit)
    return list(session.scalars(query))


def _overrides(session: Session) -> dict[str, float]:
    query = select(col(UserQuota.username), col(UserQuota.keep_finished_days)).where(
        col(UserQuota.keep_finished_days).is_not(None)
    )
    return {name: float(days) for name, days in session.execute(query)}


def _own_folder(settings: Settings, job_id: int, folder: str | None) -> Path | None:
    """The job's folder when it is where this service puts job folders; never anything else."""
    expected = jobs_root(settings) / str(job_id)
    if folder is None or Path(folder) != expected:
        if folder is not None:
            log.warning("job %d's folder %s is not %s: retention leaves it alone", job_id, folder, expected)
        return None
    return expected


def prune_array_folders(engine: Engine, settings: Settings) -> int:
    """Remove the folders of SLURM job arrays (service.backends.slurm_submit.array_root) whose jobs
    have all ended, or are gone from the ledger; returns how many went.

    An array's tasks need its folder only while they run: it is their working directory, and
    `<folder>/%a` leads each to its job's folder. SLURM keeps its own copy of the batch script. The
    folder holds that script and one link per job; removing it removes the links, never what they
    point to. Kept otherwise, one folder per array (a sweep, a batch of jobs) piled up for ever.
    """
    arrays = slurm_submit.arrays_dir(settings.data_dir)
    if not arrays.is_dir():
        return 0
    made_before = time.time() - ARRAY_FOLDER_GRACE_S
    root = jobs_root(settings)
    folders = {
        entry: slurm_submit.array_job_ids(entry, root)
        for entry in arrays.iterdir()
        if entry.is_dir() and not entry.is_symlink() and entry.lstat().st_mtime < made_before
    }
    unfinished: set[int] = set()
    with session_scope(engine) as session:
        for condition in id_conditions(col(Job.id), set().union(*folders.values())):
            query = select(col(Job.id)).where(condition, col(Job.state).not_in(TERMINAL))
            unfinished.update(session.execute(query).scalars())
    removed = 0
    for folder, job_ids in folders.items():
        if job_ids & unfinished:
            continue
        try:
            shutil.rmtree(folder)
        except OSError as error:  # this one only: the next pass tries again
            log.warning("retention: cannot remove the array folder %s: %s", folder, error)
            continue
        removed += 1
    if removed:
        log.info("retention: removed %d array folder(s) whose jobs have all ended", removed)
    return removed
