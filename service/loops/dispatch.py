"""The dispatch loop: queued jobs -> backends, in batches, safe with several service replicas.

A job is first *claimed* (claimed_by/claimed_at, FOR UPDATE SKIP LOCKED on PostgreSQL) and stays
queued while a backend takes it; only the backend's answer moves it on. A replica that dies between
the two leaves a claim behind, which service.loops.recovery settles.

Each job of a batch is prepared, recovered and recorded on its own (service.bulkhead): an
unexpected error there costs that job a tick (its reason says why; after a few in a row it fails),
never the batch. A backend that raises on a batch is given its jobs again one by one (a sweep's
array whole), so that the job that raised is found and only it pays.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import socket
import tarfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from sqlalchemy import ColumnElement, and_, update
from sqlalchemy import select as core_select
from sqlalchemy.engine import Engine, RowMapping
from sqlmodel import Session, col

from service.accounts import Account
from service.backends.base import Backend, SubmitOutcome
from service.bulkhead import Bulkhead, Fault
from service.config import Settings
from service.domain import dependencies
from service.domain.transitions import Submission, record_submissions, record_transition
from service.errors import BackendError
from service.jobfs import archive_attempt, link_code, make_job_folder
from service.ledger.db import write_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.sql import id_conditions
from service.loops import fair_claims, sweep_claims
from service.loops.code_prep import CodePreparation, Unpacking
from service.loops.recovery import CLAIM_TTL, ClaimRecovery, due
from service.states import DISPATCHABLE_STATES, JobState, is_terminal
from worker.spec import ArrayGroup, RunSpec, UpstreamJob, tracker_run_id

log = logging.getLogger(__name__)

_V = TypeVar("_V")
# A job folder that cannot be made for one of these reasons waits for a later tick instead of failing
# the job: a full disk or quota, a shared file system's stale handle or I/O error, no memory.
PASSING_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ESTALE, errno.EIO, errno.ENOMEM, errno.EAGAIN})
# A claim whose folders take long to make (a large sweep) is renewed this
# often: one older than CLAIM_TTL is another replica's to take over.
CLAIM_RENEW_S = CLAIM_TTL.total_seconds() / 6
# How often a dispatcher looks for claims a dead one left (and at every tick while some are left):
# the look is a query of its own, a tenth of a one-job tick's CPU.
STALE_CHECK_EVERY_S = 5.0
_CLAIM_COLUMNS = (
    col(Job.id),
    col(Job.name),
    col(Job.owner),
    col(Job.backend),
    col(Job.attempt),
    col(Job.folder),
    col(Job.run_as),
    col(Job.spec),
    col(Job.latest_checkpoint),
    col(Job.cancel_requested),
    col(Job.sweep_id),
    col(Job.created_at),
)


class _AccountGone(Exception):
    """The job's account or folder group no longer exists: the job cannot run as it was admitted."""


def replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class Dispatcher:
    def __init__(self, engine: Engine, backends: Mapping[str, Backend], settings: Settings) -> None:
        self._engine = engine
        self._backends = backends
        self._settings = settings
        self._replica = replica_id()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchyard-dispatch", daemon=True)
        self.last_duration_s = 0.0
        self._next_stale_check = 0.0  # time.monotonic(): the first tick looks
        self.bulkhead = Bulkhead("dispatching")
        self.waiting_bulkhead = Bulkhead("settling dependencies")
        self._recovery = ClaimRecovery(engine, backends, self._replica, self.bulkhead)
        self._upstream: dict[int, list[UpstreamJob]] = {}  # the claimed jobs' (dependencies.upstream_jobs)
        self._code = CodePreparation(settings, self.wake)  # code copies, made off this thread

    # ---------------------------------------------------------------- loop

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)
        self._code.stop()

    def wake(self) -> None:
        """Called when new jobs are committed: dispatch now, not at the next interval."""
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._settings.dispatch_interval_s)
            self._wake.clear()
            try:
                while not self._stop.is_set() and self.dispatch_once() >= self._settings.dispatch_batch_size:
                    pass
            except Exception:  # the loop must outlive a bad tick (database down, ...)
                log.exception("dispatch tick failed; retrying")

    def dispatch_once(self) -> int:
        """Claim one batch of queued jobs and hand them to their backends. Returns how many were claimed."""
        started = time.perf_counter()
        if time.monotonic() >= self._next_stale_check:  # claims a dead dispatcher left behind
            left = self._recovery.run()
            self._next_stale_check = time.monotonic() + (0.0 if left else STALE_CHECK_EVERY_S)
        # Jobs whose dependencies ended: queued (and claimed below, in this same tick), or cancelled.
        dependencies.settle_due(self._engine, self.waiting_bulkhead)
        claimed = self._claim()
        by_backend: dict[str, list[RunSpec]] = defaultdict(list)
        for backend_name, spec in self._prepare_all(claimed):
            by_backend[backend_name].append(spec)
        for backend_name, specs in by_backend.items():
            self._submit(backend_name, specs)
        self.last_duration_s = time.perf_counter() - started
        return len(claimed)

    # ---------------------------------------------------------------- claim

    def _claim(self) -> list[tuple[RowMapping, ArrayGroup | None]]:
        """Up to a batch of queued jobs, marked as this replica's (those cancelled meanwhile end here).

        Core rather than ORM objects: a batch is hundreds of rows, and the claim is bookkeeping only
        (no state change, nothing a reader sees), so it is one SELECT and one UPDATE. The job folders
        are made after it commits (_prepare_all): on SQLite the claim holds the one write lock, and
        a sweep's hundreds of folders would hold every new job's commit.
        """
        with write_scope(self._engine) as session:
            unpacking = self._code.waiting()  # not claimed again until their code copy is made
            waiting = and_(due(), col(Job.claimed_by).is_(None), col(Job.id).not_in(unpacking))
            seen = sweep_claims.room_left(session, waiting, self._backends)
            turns = fair_claims.turns(and_(waiting, sweep_claims.not_full(seen)))
            query = (
                core_select(*_CLAIM_COLUMNS)
                .join(turns, turns.c.id == col(Job.id))
                .where(waiting)
                .order_by(turns.c.turn, col(Job.id))
                .limit(self._settings.dispatch_batch_size)
                .with_for_update(skip_locked=True, of=Job)
            )
            found = list(session.connection().execute(query).mappings())
            room = sweep_claims.room_now(session, [row["sweep_id"] for row in found], self._backends)
            rows = sweep_claims.within_room(found, room)
            rest = sweep_claims.rest_of_sweeps(rows, self._backends, room)
            if rest is not None:  # the whole sweep, so that it leaves as one array
                more = core_select(*_CLAIM_COLUMNS).where(waiting, rest).order_by(col(Job.id))
                rows += list(session.connection().execute(more.with_for_update(skip_locked=True)).mappings())
            groups = sweep_claims.array_groups(session, {row["sweep_id"] for row in rows} - {None})
            claimed = [(row, groups.get(row["sweep_id"])) for row in rows if not row["cancel_requested"]]
            self._upstream = dependencies.upstream_jobs(session, [row["id"] for row, _ in claimed])
            _set_claims(session, [row["id"] for row, _ in claimed], claimed_by=self._replica)
            for row in rows:
                if row["cancel_requested"]:
                    job = session.get(Job, row["id"])
                    assert job is not None  # locked by the SELECT above
                    record_transition(session, job, JobState.cancelled, "cancelled by user before dispatch")
            return claimed

    def _prepare_all(self, claimed: list[tuple[RowMapping, ArrayGroup | None]]) -> list[tuple[str, RunSpec]]:
        """The claimed jobs' specs, their folders made. A job whose folder cannot be made fails here,
        unless the reason passes (PASSING_ERRNOS): then it waits for a later tick. An unexpected
        error is that job's fault (the bulkhead's): it waits for a later tick, or fails after a few."""
        accounts = functools.cache(Account.of_job)  # one passwd lookup per account, not per job
        ready: list[tuple[str, RunSpec]] = []
        unfit: list[tuple[int, str]] = []  # (job id, why it ends here)
        later: list[tuple[int, str]] = []  # (job id, why): a later tick tries again
        ids = [row["id"] for row, _ in claimed]
        started = renewed = time.monotonic()
        for row, group in claimed:
            if time.monotonic() - renewed > CLAIM_RENEW_S:
                self._renew_claims(ids)
                renewed = time.monotonic()
            prepared = self.bulkhead.guarded(
                row["id"], functools.partial(self._prepare, row, group, accounts)
            )
            if isinstance(prepared, Fault):
                (unfit if prepared.gives_up else later).append((row["id"], prepared.reason))
            elif isinstance(prepared, str):
                unfit.append((row["id"], prepared))
            elif isinstance(prepared, Unpacking):
                later.append((row["id"], str(prepared)))
            elif isinstance(prepared, OSError):
                text = f"cannot write the job folder: {prepared}"
                later.append((row["id"], f"dispatch failed, will retry: {text}"))
            else:
                ready.append((row["backend"], prepared))
        if time.monotonic() - started > CLAIM_RENEW_S:  # the submission starts with a fresh claim
            self._renew_claims(ids)
        self._fail_unfit(unfit)
        for job_id, reason in later:
            self._release([job_id], reason)
        return ready

    def _renew_claims(self, job_ids: Sequence[int]) -> None:
        with write_scope(self._engine) as session:
            _set_claims(session, job_ids, col(Job.claimed_by) == self._replica)

    def _fail_unfit(self, unfit: list[tuple[int, str]]) -> None:
        """End the jobs whose folder could not be made, unless a user's cancel got there first."""
        if not unfit:
            return
        with write_scope(self._engine) as session:
            for job_id, failure in unfit:
                job = session.get(Job, job_id, with_for_update=True)
                if job is None or job.claimed_by != self._replica or is_terminal(JobState(job.state)):
                    continue
                job.claimed_by = job.claimed_at = None
                session.add(job)
                record_transition(session, job, JobState.failed, failure)  # or cancelled, if its user asked

    def _prepare(
        self, job: RowMapping, group: ArrayGroup | None, accounts: Callable[[str | None], Account]
    ) -> RunSpec | str | OSError | Unpacking:
        """The job's spec, its folder made; else why the job cannot go (a text: it fails), the
        passing error its folder met (an OSError of PASSING_ERRNOS: a later tick tries again), or
        Unpacking (its code copy is being made: it waits, and no tick waits for it)."""
        try:
            return self._prepare_folder(job, group, accounts)
        except Unpacking as waiting:
            return waiting
        except OSError as error:
            if error.errno in PASSING_ERRNOS:
                return error
            return f"cannot write the job folder: {error}"
        except tarfile.TarError as error:  # the job's code snapshot
            return f"cannot write the job folder: {error}"
        except _AccountGone as gone:
            return str(gone)

    def _prepare_folder(
        self, job: RowMapping, group: ArrayGroup | None, accounts: Callable[[str | None], Account]
    ) -> RunSpec:
        assert job["folder"] is not None
        spec = RunSpec(
            group=group,
            job_id=job["id"],
            name=job["name"],
            attempt=job["attempt"],
            folder=job["folder"],
            rendezvous_timeout_s=self._settings.rendezvous_timeout_s,
            resume_from=job["latest_checkpoint"],
            run_as=job["run_as"],
            upstream=self._upstream.get(job["id"], []),
            run_id=tracker_run_id(job["id"], job["created_at"]),
            **job["spec"],
        )
        try:  # pwd's and grp's KeyError: the account or the group is gone since admission
            account = accounts(spec.run_as)
            tree = None if spec.code is None else self._code.ready(job["owner"], spec, account)
            if spec.attempt > 1:
                archive_attempt(spec.files, spec.attempt - 1, spec.resources.world_size)
            make_job_folder(spec.files, account, self._settings.job_folder_group)
        except KeyError:
            raise _AccountGone(
                f"the Unix account '{spec.run_as}' (or the job folder group) no longer exists on the "
                "service's host"
            ) from None
        if tree is not None:
            link_code(spec.files.folder, tree)
        return spec

    # ---------------------------------------------------------------- submit

    def _submit(self, backend_name: str, specs: Sequence[RunSpec]) -> None:
        backend = self._backends.get(backend_name)
        try:
            if backend is None:
                raise BackendError(f"backend '{backend_name}' is not configured on this service")
            outcomes = backend.submit(specs)
        except BackendError as error:
            log.warning("backend %s refused a batch of %d: %s", backend_name, len(specs), error)
            self._release([spec.job_id for spec in specs], f"dispatch failed, will retry: {error}")
            return
        except Exception as error:  # not the scheduler's: something about some job of the batch
            units = sweep_claims.units(specs)
            if len(units) > 1:
                for unit in units:  # each alone, so that only the one that raises pays
                    self._submit(backend_name, unit)
                return
            faults = [self.bulkhead.fault(spec.job_id, error) for spec in specs]
            self._fail_unfit([(fault.job_id, fault.reason) for fault in faults if fault.gives_up])
            for fault in faults:
                if not fault.gives_up:
                    self._release([fault.job_id], fault.reason)
            return
        self._record(backend, outcomes)

    def _release(self, job_ids: Sequence[int], reason: str) -> None:
        with write_scope(self._engine) as session:
            for job_id in job_ids:
                _unclaim(session, job_id, reason)

    def _record(self, backend: Backend, outcomes: Sequence[SubmitOutcome]) -> None:
        """The backend's answers into the ledger. The usual one (accepted, still queued, nobody asked
        to cancel) goes in bulk; refusals and cancels that raced the submission go one by one."""
        to_cancel: list[str] = []
        with write_scope(self._engine) as session:
            found = _locked_queue_rows(session, [outcome.job_id for outcome in outcomes])
            accepted: list[Submission] = []
            for outcome in outcomes:
                row = found.get(outcome.job_id)
                if row is None:
                    continue
                if outcome.transient:  # as when the whole batch is refused: queued for the next tick
                    _unclaim(session, outcome.job_id, f"dispatch failed, will retry: {outcome.error}")
                    continue
                state = JobState(row["state"])
                if outcome.accepted and state in DISPATCHABLE_STATES and not row["cancel_requested"]:
                    reason = f"{backend.name} id {outcome.external_id}"
                    accepted.append(
                        Submission(outcome.job_id, state, row["attempt"], str(outcome.external_id), reason)
                    )
                    continue
                job = session.get(Job, outcome.job_id)
                assert job is not None  # locked above
                record = functools.partial(self._record_one, session, job, outcome, backend)
                if self.bulkhead.guarded(outcome.job_id, record, session) is True:
                    to_cancel.append(str(outcome.external_id))
            record_submissions(session, accepted)  # the usual answer, in bulk: the door's rules
        if to_cancel:
            backend.cancel(to_cancel)

    @staticmethod
    def _record_one(session: Session, job: Job, outcome: SubmitOutcome, backend: Backend) -> bool:
        """A refusal, or an acceptance for a job its user cancelled meanwhile; True when the run the
        backend accepted must be stopped."""
        job.claimed_by = job.claimed_at = None
        session.add(job)
        if not outcome.accepted:
            record_transition(session, job, JobState.failed, outcome.error or "rejected by the backend")
            return False
        assert outcome.external_id is not None
        if is_terminal(JobState(job.state)):  # cancelled before the backend answered
            job.external_id = outcome.external_id
            return True
        reason = f"{backend.name} id {outcome.external_id}"
        moved = record_transition(session, job, JobState.submitted, reason, external_id=outcome.external_id)
        return moved is JobState.cancelled


def _unclaim(session: Session, job_id: int, reason: str) -> None:
    """Give the job back to the queue, saying why: a later tick submits it again."""
    job = session.get(Job, job_id)
    if job is not None:
        job.claimed_by = job.claimed_at = None
        job.reason = reason
        session.add(job)


def _set_claims(
    session: Session, job_ids: Sequence[int], *where: ColumnElement[bool], **values: object
) -> None:
    """Stamp these jobs' claims now (with `values`, where `where` holds): one UPDATE per id chunk."""
    for condition in id_conditions(col(Job.id), job_ids):
        session.execute(
            update(Job).where(condition, *where).values(claimed_at=utcnow(), **values),
            execution_options={"synchronize_session": False},
        )


_QUEUE_COLUMNS = (col(Job.id), col(Job.state), col(Job.attempt), col(Job.cancel_requested))


def _locked_queue_rows(session: Session, job_ids: Sequence[int]) -> dict[int, RowMapping]:
    """These jobs' state, attempt and cancel flag, row-locked (FOR UPDATE on PostgreSQL) in one query
    per chunk rather than one each."""
    found: dict[int, RowMapping] = {}
    connection = session.connection()
    for condition in id_conditions(col(Job.id), job_ids):
        query = core_select(*_QUEUE_COLUMNS).where(condition).order_by(col(Job.id)).with_for_update()
        found.update((row["id"], row) for row in connection.execute(query).mappings())
    return found
