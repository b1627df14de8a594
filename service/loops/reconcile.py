"""The reconcile loop: backend states, progress files and results -> ledger.

Per backend and per interval it makes ONE batched status query for all the jobs that backend holds;
API readers never cause one. Several replicas may reconcile the same jobs: each job is updated under
a row lock (FOR UPDATE SKIP LOCKED on PostgreSQL), and never from a status older than its last change.
A terminal state from the scheduler is confirmed against the job folder (rank 0's result, the ranks'
error files) before it is written. Each job's part of a tick runs in its own savepoint (a bulkhead).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from service.accounts import NodeHardlinks
from service.backends.base import Backend, BackendStatus
from service.bulkhead import Bulkhead, Fault
from service.domain.captures import Captures
from service.domain.endings import Ending, settle, with_stacks
from service.domain.transitions import end_attempt, record_transition, record_waiting
from service.errors import BackendError
from service.jobfs import read_placement, read_result, result_written
from service.ledger.db import session_scope, write_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.sql import id_conditions
from service.loops.files_grace import FilesGrace
from service.loops.progress import ingest_progress
from service.loops.sweep_pruning import SweepPruning
from service.loops.sweep_search import SweepSearch
from service.loops.watch import Watch, stacks_summary
from service.states import WATCHED_STATES, JobState, can_transition, is_terminal
from worker.spec import JobFiles

log = logging.getLogger(__name__)

WATCHED_COLUMNS = (col(Job.id), col(Job.external_id), col(Job.state), col(Job.reason), col(Job.folder),
                   col(Job.expected_start_at))  # fmt: skip
# SLURM's backfill pass moves a waiting job's estimate by seconds; writing each move would restamp
# (and so re-send to every follower) a long queue every pass.
ESTIMATE_SLACK = timedelta(seconds=60)
RESULT_CHECK_S = 0.25  # between ticks, rank 0's result is looked for this often
RESULT_CHECKS_PER_PASS = 500  # above this many watched jobs, the passes space out to keep the stats bounded
REAP_GRACE_S = 60.0  # a job ended by its result may take this long to exit before it is stopped
MAX_LEDGER_BACKOFF_S = 5.0  # the database is down: it is ours, and the ledger should catch up soon after


class Reconciler:
    """One thread per backend, each on its own interval, woken early by its backend."""

    def __init__(
        self, engine: Engine, backends: Mapping[str, Backend], captures: Captures, grace_s: float,
        search: SweepSearch | None = None,  # a search's next trials (the intake stores them)
    ) -> None:
        self._engine = engine
        self.files_grace = FilesGrace(grace_s)  # an ended attempt's files may show up late
        self._backends = backends
        self._stop = threading.Event()
        self._wakes = {name: threading.Event() for name in backends}
        self._threads = [
            threading.Thread(target=self._run, args=(name,), name=f"torchyard-reconcile-{name}", daemon=True)
            for name in backends
        ]
        self.ticks: dict[str, int] = dict.fromkeys(backends, 0)
        # Per backend, the jobs its last tick watched: job id -> (its run's id, its files); the runs
        # ended by their result, watched until they are gone (id -> deadline); and what to cancel,
        # until the backend has been told.
        self._watched: dict[str, dict[int, tuple[str, JobFiles]]] = {name: {} for name in backends}
        self._reaps: dict[str, dict[str, float]] = {name: {} for name in backends}
        self._cancels: dict[str, set[str]] = {name: set() for name in backends}
        self.last_duration_s: dict[str, float] = dict.fromkeys(backends, 0.0)
        self.bulkhead = Bulkhead("reconciling")
        self.watch = Watch(engine, backends, captures, self._cancel_later)  # stalls (service.loops.watch)
        self.watch_bulkhead = Bulkhead("watching")  # its faults are counted, never fail a job
        self.pruning = SweepPruning(engine, self._cancel_later)  # sweeps' early stopping
        self.search = search
        self.hardlinks = NodeHardlinks()  # what the ranks' placement files say of their nodes
        for name, backend in backends.items():
            backend.set_wakeup(self._wakes[name].set)

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        self._stop.set()
        for wake in self._wakes.values():
            wake.set()
        for thread in self._threads:
            thread.join(timeout=10)

    def wake(self, backend_name: str) -> None:
        if backend_name in self._wakes:
            self._wakes[backend_name].set()

    def interval(self, backend_name: str) -> float:
        return self._backends[backend_name].poll_interval_s

    def _run(self, backend_name: str) -> None:
        """Tick at the backend's interval. A scheduler that does not answer is the backend's to back
        off from (its poll refuses at once, without a call, while it waits: service.backends.slurm), so
        the loop keeps its pace and goes on with what needs no scheduler (results, cancels); only the
        ledger, this loop's own, is waited for here."""
        delay = 0.0
        failing = False  # the scheduler stopped answering: said once, and again once it answers
        while not self._stop.is_set():
            self._wait_looking_for_results(backend_name, delay)
            self._wakes[backend_name].clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile_once(backend_name)
                if failing:
                    log.warning("%s answers its status queries again", backend_name)
                delay, failing = self.interval(backend_name), False
            except BackendError as error:
                delay = self.interval(backend_name)
                (log.debug if failing else log.warning)("%s status query failed: %s", backend_name, error)
                failing = True
            except Exception:
                delay = min(MAX_LEDGER_BACKOFF_S, max(self.interval(backend_name), delay) * 2)
                log.exception("reconcile of %s failed; next try in %.0f s", backend_name, delay)

    def _wait_looking_for_results(self, backend_name: str, delay: float) -> None:
        """Wait `delay` (or until woken), looking for rank 0's result of the watched jobs meanwhile:
        a finished job is noticed within RESULT_CHECK_S, not at the next tick, and with no
        scheduler call (one stat per job; passes space out when many jobs are watched)."""
        deadline = time.monotonic() + delay
        while (remaining := deadline - time.monotonic()) > 0:
            watched = self._watched[backend_name]
            gap = RESULT_CHECK_S * max(1.0, len(watched) / RESULT_CHECKS_PER_PASS)
            if self._wakes[backend_name].wait(min(remaining, gap)) or self._stop.is_set():
                return
            try:
                self.settle_results(backend_name)
            except Exception:  # the database is down: the next tick says so and backs off
                log.debug("result pass of %s failed", backend_name, exc_info=True)

    def settle_results(self, backend_name: str) -> int:
        """End the watched jobs whose rank 0 has written its result; how many it ended."""
        watched = self._watched[backend_name]
        found = [(job_id, run) for job_id, (run, files) in watched.items() if result_written(files)]
        ended = 0
        if not found:
            return 0
        with write_scope(self._engine) as session:
            jobs = _lock_rows(session, [job_id for job_id, _ in found])
            for job_id, external_id in found:
                watched.pop(job_id, None)
                job = jobs.get(job_id)
                if job is None or not _still_the_run(job, external_id):
                    continue
                settle = functools.partial(self._settle_result, session, job, backend_name)
                outcome = self.bulkhead.guarded(job_id, settle, session)
                if isinstance(outcome, Fault):
                    if self._record_fault(session, job, outcome):
                        self._cancels[backend_name].add(external_id)
                elif outcome:
                    ended += 1
        return ended

    def _settle_result(self, session: Session, job: Job, backend_name: str) -> bool:
        """End `job` by its rank 0's result; False while there is no whole result (yet)."""
        files = JobFiles(Path(job.folder or "."))
        result = read_result(files, job.run_attempt)
        if result is None:  # not a whole result (yet): the next tick reads it again
            return False
        self._succeed(session, job, files, result["value"], backend_name)
        return True

    def _succeed(self, session: Session, job: Job, files: JobFiles, value: Any, backend_name: str) -> None:
        """Rank 0's result: the job is done for its user. Its progress and placement are read again
        first: no tick reads an ended job's (a final loss was lost so once; a placement, by a job
        that ended before a tick saw it running)."""
        ingest_progress(session, job, files.progress)
        self._note_placement(job, files)
        job.result = value
        self._move(session, job, JobState.succeeded, "completed")
        if job.external_id is not None:
            self._reap_later(backend_name, job.external_id)

    def _note_placement(self, job: Job, files: JobFiles) -> None:
        if len(job.placement or []) >= (world := job.resources.world_size):
            return  # every rank's is known: no file system call a tick
        placement = read_placement(files, job.run_attempt or job.attempt, world)
        if placement and placement != job.placement:  # a row of the caller's session: written at its commit
            job.placement = placement
            self.hardlinks.note(job.id or 0, placement)

    def _reap_later(self, backend_name: str, external_id: str) -> None:
        """A job ended by its result: if its processes still run REAP_GRACE_S from now (a job may write
        its result early and go on, outside its quota), the backend is told to stop them."""
        self._reaps[backend_name][external_id] = time.monotonic() + REAP_GRACE_S

    def _cancel_pending(self, backend_name: str) -> None:
        """Cancel what the ticks decided to stop; what the backend refuses now is asked again next tick
        (a previous attempt left running would share its folder with the next one)."""
        if pending := self._cancels[backend_name]:
            runs = sorted(pending)  # the watchdog's threads add to it too (_cancel_later)
            self._backends[backend_name].cancel(runs)
            pending.difference_update(runs)

    def _cancel_later(self, backend_name: str, external_id: str) -> None:
        self._cancels[backend_name].add(external_id)
        self.wake(backend_name)

    # ---------------------------------------------------------------- one tick

    def reconcile_once(self, backend_name: str) -> int:
        """Bring every job `backend_name` holds up to date. Returns how many jobs were looked at."""
        started = time.perf_counter()
        backend = self._backends[backend_name]
        with session_scope(self._engine) as session:
            watched = session.execute(  # six columns: more than sqlmodel's select() is typed for
                select(*WATCHED_COLUMNS).where(
                    col(Job.backend) == backend_name,
                    col(Job.state).in_([s.value for s in WATCHED_STATES]),
                    col(Job.external_id).is_not(None),
                )
            ).all()
        self._watched[backend_name] = {
            job_id: (str(external_id), JobFiles(Path(folder)))
            for job_id, external_id, _, _, folder, _ in watched
            if job_id and folder
        }
        reaps = self._reaps[backend_name]
        asked = [str(external_id) for _, external_id, *_ in watched] + list(reaps)
        if not asked:
            self._cancel_pending(backend_name)
            return 0
        polled_at = utcnow()
        statuses = backend.poll(asked)  # the one query
        self.ticks[backend_name] += 1
        for external_id, deadline in list(reaps.items()):
            status = statuses.get(external_id)
            if status is None or is_terminal(status.state):
                del reaps[external_id]  # gone as a finished job goes
            elif time.monotonic() >= deadline:
                del reaps[external_id]
                log.warning("job %s runs on after its result: stopping it", external_id)
                self._cancels[backend_name].add(external_id)
        newly_queued: dict[int, str | None] = {}  # submitted -> pending, written together below
        changed: list[tuple[int, str, BackendStatus | None]] = []
        for job_id, external_id, state, reason, _, expected_start in watched:
            assert job_id is not None  # a primary key, typed optional by the model
            status = statuses.get(str(external_id))
            if _still_waiting(state, reason, expected_start, status):
                continue  # most of a long queue, most ticks: nothing to lock, read or write
            if status is not None and state == JobState.submitted and status.state is JobState.pending:
                newly_queued[job_id] = status.reason  # not started: no file of its own to read
                continue
            changed.append((job_id, str(external_id), status))
        if changed or newly_queued:
            self._write_changes(backend_name, changed, newly_queued, polled_at)
        self.watch.after_tick(backend_name)  # committed: the stalls it found are captured and flagged
        self.pruning.after_tick(backend_name)  # the metrics just read decide which trials go on
        if self.search is not None:  # after pruning: a trial it stopped has ended, and leaves room
            self.search.after_tick(backend_name, moved=bool(changed))
        self._cancel_pending(backend_name)
        self.last_duration_s[backend_name] = time.perf_counter() - started
        return len(watched)

    def _write_changes(
        self,
        backend_name: str,
        changed: list[tuple[int, str, BackendStatus | None]],
        newly_queued: dict[int, str | None],
        polled_at: datetime,
    ) -> None:
        """One transaction for the tick's changes, each job's in a savepoint of its own."""
        to_cancel = self._cancels[backend_name]
        with write_scope(self._engine) as session:
            jobs = _lock_rows(session, [job_id for job_id, _, _ in changed])
            for job_id, external_id, status in changed:
                if self._stop.is_set():
                    break  # stopping: what is done so far commits, the rest waits for the next start
                # Replicas reconcile the same jobs. A row another one holds is being written right now
                # (not locked here), and a row changed since our poll already has a newer word than
                # ours: leave both to the next tick, so no transition is written twice or undone by a
                # stale status. A row of another run (a retry went out since the poll) is not this
                # status's either.
                job = jobs.get(job_id)
                if job is None or not _still_the_run(job, external_id) or job.updated_at > polled_at:
                    continue
                apply = functools.partial(self._apply, session, job, status, backend_name)
                outcome = self.bulkhead.guarded(job_id, apply, session)
                if isinstance(outcome, Fault) and self._record_fault(session, job, outcome):
                    to_cancel.add(external_id)
            record_waiting(session, newly_queued, unchanged_since=polled_at)

    def _apply(self, session: Session, job: Job, status: BackendStatus | None, backend_name: str) -> None:
        """Update one job from the scheduler's word and its folder."""
        files = JobFiles(Path(job.folder or "."))
        if ingest_progress(session, job, files.progress) and job.sweep_id is not None:
            self.pruning.reported(backend_name, job.sweep_id)
        if status is None:
            return  # the scheduler does not list it (yet): ask again next tick
        if status.nodes and status.nodes != job.nodes:
            job.nodes = status.nodes
            session.add(job)
        if _estimate_moved(job.expected_start_at, status.expected_start):
            job.expected_start_at = status.expected_start
            session.add(job)
        target = JobState(status.state)
        # Only running ranks write placement files (a long queue's waiting jobs are no file system
        # call a tick); a short attempt can end between two ticks: once more at its end.
        if target is JobState.running or is_terminal(target):
            self._note_placement(job, files)
        if target is JobState.running:
            # A rank's error file while the others run is not read here: the job's supervisor (worker.
            # supervisor) ends or restarts the run itself within a tick, and an error it restarts
            # from must not end the attempt.
            result = read_result(files, job.run_attempt)
            if result is not None:
                self._succeed(session, job, files, result["value"], backend_name)
                return
            if JobState(job.state) is JobState.running:
                watch = functools.partial(self.watch.check, session, job, backend_name)
                self.watch_bulkhead.guarded(job.id or 0, watch, session)
        if not is_terminal(target):
            self._move(session, job, target, status.reason)
            return
        waiting = self.files_grace.still_open(job.id or 0)
        settled = settle(job, files, status, self._backends[backend_name], files_may_follow=waiting)
        if settled is None:
            return  # nothing says how it ended yet: the next tick looks again
        self.files_grace.forget(job.id or 0)
        end_attempt(session, job, with_stacks(settled, stacks_summary(session, job)), status.exit_code)

    @staticmethod
    def _record_fault(session: Session, job: Job, fault: Fault) -> bool:
        """Tell `job`'s user what failed on it (its reason); when the bulkhead gives up, fail it. True
        when its ranks must be stopped."""
        try:
            with session.begin_nested():
                if not fault.gives_up:
                    record_transition(session, job, JobState(job.state), fault.reason)
                    return False
                end_attempt(session, job, Ending(JobState.failed, "failure", fault.reason), None)
                return True
        except Exception:  # its row cannot be written either: the log and /metrics still say it
            log.exception("job %s: its fault could not be recorded on it", job.id)
            return False

    @staticmethod
    def _move(session: Session, job: Job, target: JobState, reason: str | None) -> None:
        current = JobState(job.state)
        if current is target or can_transition(current, target):
            record_transition(session, job, target, reason)
        elif current is JobState.submitted and can_transition(JobState.pending, target):
            record_transition(session, job, JobState.pending, None)
            record_transition(session, job, target, reason)


def _lock_rows(session: Session, job_ids: list[int]) -> dict[int, Job]:
    """These jobs, each locked for this transaction, leaving out those another replica holds: one
    read for all. A row read at a time cost each job its own query and an autoflush of the one
    before: settling 400 cancelled jobs took 1.44 ms a job that way, 0.45 ms so (SQLite)."""
    jobs: dict[int, Job] = {}
    for condition in id_conditions(col(Job.id), job_ids):
        query = select(Job).where(condition).with_for_update(skip_locked=True)
        jobs.update((job.id, job) for job in session.scalars(query) if job.id is not None)
    return jobs


def _still_the_run(job: Job, external_id: str) -> bool:
    """The job is still held by the backend as the run `external_id` (not ended, not on to a retry)."""
    return JobState(job.state) in WATCHED_STATES and job.external_id == external_id


def _still_waiting(
    state: str, reason: str | None, expected_start: datetime | None, status: BackendStatus | None
) -> bool:
    """Pending in the ledger and still pending, for the same reason and about the same expected
    start, in the scheduler: no change.

    Its ranks have not started, so it has no progress, result or error file to read either."""
    return (
        status is not None
        and state == JobState.pending
        and status.state is JobState.pending
        and status.reason in (None, reason)
        and not _estimate_moved(expected_start, status.expected_start)
    )


def _estimate_moved(known: datetime | None, new: datetime | None) -> bool:
    if known is None or new is None:
        return known is not new
    return abs(new - known) >= ESTIMATE_SLACK
