"""Claims a dead dispatcher left behind: adopted when the backend already has the job, freed for a new
submission when it does not, kept while it cannot tell yet.

A job is claimed (claimed_by/claimed_at) while a backend takes it; a replica that dies between the
claim and the backend's answer leaves the claim behind. The job's submitit folder then tells whether
the backend already has it (`<id>_submitted.pkl`, named once the backend answered, and only if the
scheduler does not show that id as another folder's job: the folder is the job's account's to
change); when the replica died while the backend was still answering, the backend's `recover` asks
the scheduler. What it has is adopted, never submitted again.

In three steps, so that no scheduler call is made while a row is locked: the stale claims are read
(no lock), the folders and the scheduler are asked (no transaction), then each claim is settled in a
write transaction, locked, if it is still the claim that was read (another replica may have settled
it meanwhile). Each job's part is in the dispatcher's bulkhead: a folder or an answer that makes the
backend raise costs that job alone.
"""

from __future__ import annotations

import functools
import logging
import socket
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

from sqlalchemy import ColumnElement, and_, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session, col, select

from service.backends.base import Backend
from service.bulkhead import Bulkhead, Fault
from service.domain.transitions import record_transition
from service.errors import BackendError
from service.jobfs import submitted_external_id
from service.ledger.db import session_scope, write_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.states import JobState
from worker.spec import JobFiles, ascii_int

log = logging.getLogger(__name__)

CLAIM_TTL = timedelta(seconds=60)
_V = TypeVar("_V")


class _Keep:
    """A claim to look at again later (the scheduler could not tell yet)."""


KEEP = _Keep()
# What a stale claim becomes: the backend's run (its id), queued again (None), kept for a later
# look (KEEP), or a fault told on the job.
Answer = str | None | _Keep | Fault


@dataclass(frozen=True)
class _Stale:
    job_id: int
    backend: str
    folder: Path
    claimed_by: str | None
    claimed_at: datetime | None


def due() -> ColumnElement[bool]:
    """Jobs to hand to a backend now: the queued ones, and the retries whose backoff is over."""
    return or_(
        col(Job.state) == JobState.queued,
        and_(col(Job.state) == JobState.retrying, col(Job.retry_at) <= utcnow()),
    )


class ClaimRecovery:
    """The dispatcher's look at claims left behind; `run` returns True while some must be looked at
    again (the scheduler could not tell yet)."""

    def __init__(
        self, engine: Engine, backends: Mapping[str, Backend], replica: str, bulkhead: Bulkhead
    ) -> None:
        self._engine = engine
        self._backends = backends
        self._replica = replica
        self._bulkhead = bulkhead

    def run(self) -> bool:
        stale = self._stale()
        if not stale:
            return False
        answers: dict[int, Answer] = {}
        for backend_name, jobs in _by_backend(stale).items():
            answers.update(self._ask(backend_name, jobs))
        runs_to_stop = self._settle(stale, answers)
        for backend_name, external_ids in runs_to_stop.items():
            self._stop(backend_name, external_ids)
        return any(isinstance(answer, _Keep | Fault) for answer in answers.values())

    # ---------------------------------------------------------------- 1. read

    def _stale(self) -> list[_Stale]:
        with session_scope(self._engine) as session:
            query = select(Job).where(due(), col(Job.claimed_by).is_not(None))
            return [
                _Stale(job.id, job.backend, Path(job.folder or "."), job.claimed_by, job.claimed_at)
                for job in session.exec(query)
                if job.id is not None and self._is_stale(job.claimed_by, job.claimed_at)
            ]

    def _is_stale(self, claimed_by: str | None, claimed_at: datetime | None) -> bool:
        """Older than CLAIM_TTL, or made by a process of this host that is gone."""
        if claimed_at is not None and utcnow() - claimed_at > CLAIM_TTL:
            return True
        host, _, pid = (claimed_by or "").rpartition(":")
        if host != socket.gethostname() or ascii_int(pid) is None or claimed_by == self._replica:
            return False
        return not Path(f"/proc/{pid}").exists()

    # ---------------------------------------------------------------- 2. ask, no transaction open

    def _ask(self, backend_name: str, jobs: list[_Stale]) -> dict[int, Answer]:
        """Each job's answer: the id the backend has it under, None (queue it again), KEEP, a Fault."""
        answers: dict[int, Answer] = {}
        named: dict[Path, tuple[_Stale, str]] = {}
        unsure: list[_Stale] = []
        for job in jobs:
            found = self._bulkhead.guarded(
                job.job_id, functools.partial(submitted_external_id, JobFiles(job.folder))
            )
            if isinstance(found, Fault):
                answers[job.job_id] = found
            elif found is None:
                unsure.append(job)
            else:
                named[job.folder] = (job, found)
        backend = self._backends.get(backend_name)
        if backend is None:  # submitting again fails and says why
            return {**answers, **dict.fromkeys(job.job_id for job in jobs if job.job_id not in answers)}
        others = self._per_job(
            {folder: job for folder, (job, _) in named.items()},
            lambda some: dict.fromkeys(backend.disowned({f: named[f][1] for f in some}), True),
            answers,
        )
        for folder, (job, external_id) in named.items():
            if others is None:  # the scheduler cannot be asked: keep the claim for the next look
                answers.setdefault(job.job_id, KEEP)
            elif folder in others:  # a name the job's account made: as if there were none
                unsure.append(job)
            else:
                answers.setdefault(job.job_id, external_id)
        recovered = self._per_job(
            {job.folder: job for job in unsure}, lambda some: backend.recover(list(some)), answers
        )
        for job in unsure:
            answers.setdefault(
                job.job_id,
                KEEP if recovered is None or job.folder not in recovered else recovered[job.folder],
            )
        return answers

    def _per_job(
        self,
        jobs: dict[Path, _Stale],
        ask: Callable[[Sequence[Path]], dict[Path, _V]],
        faults: dict[int, Answer],
    ) -> dict[Path, _V] | None:
        """ask(the folders) of the backend for all of these jobs at once (None when the scheduler
        cannot be asked); when it raises anything but BackendError (which is everyone's), again for
        each job alone, so that only the job whose folder made it raise pays (a fault in `faults`)."""
        if not jobs:
            return {}
        try:
            return ask(list(jobs))
        except BackendError as error:
            log.warning("cannot settle %d claim(s) left behind yet: %s", len(jobs), error)
            return None
        except Exception as error:
            if len(jobs) == 1:
                (job,) = jobs.values()
                faults[job.job_id] = self._bulkhead.fault(job.job_id, error)
                return {}
        answers: dict[Path, _V] = {}
        for folder, job in jobs.items():
            one = self._per_job({folder: job}, ask, faults)
            if one is None:
                return None
            answers.update(one)
        return answers

    # ---------------------------------------------------------------- 3. settle, each locked

    def _settle(self, stale: list[_Stale], answers: Mapping[int, Answer]) -> dict[str, list[str]]:
        """The answers written, for each claim still as it was read; the runs to stop by backend (ids
        adopted for jobs their users cancelled meanwhile)."""
        runs_to_stop: dict[str, list[str]] = defaultdict(list)
        with write_scope(self._engine) as session:
            for one in stale:
                answer = answers.get(one.job_id, KEEP)
                if isinstance(answer, _Keep):
                    continue
                job = session.get(Job, one.job_id, with_for_update=True)
                if job is None or (job.claimed_by, job.claimed_at) != (one.claimed_by, one.claimed_at):
                    continue  # settled by another replica meanwhile, or claimed anew
                if isinstance(answer, Fault):
                    _tell_fault(session, job, answer)
                elif _release(session, job, answer) and answer is not None:
                    runs_to_stop[one.backend].append(answer)
        return runs_to_stop

    def _stop(self, backend_name: str, external_ids: list[str]) -> None:
        backend = self._backends.get(backend_name)
        try:
            if backend is not None:
                backend.cancel(external_ids)
        except BackendError as error:  # recorded cancelled: the reconciler no longer watches them
            log.warning(
                "could not stop %d cancelled job(s) on %s: %s", len(external_ids), backend_name, error
            )


def _by_backend(stale: list[_Stale]) -> dict[str, list[_Stale]]:
    grouped: dict[str, list[_Stale]] = defaultdict(list)
    for job in stale:
        grouped[job.backend].append(job)
    return grouped


def _release(session: Session, job: Job, external_id: str | None) -> bool:
    """End a dead dispatcher's claim: the job is the backend's `external_id`, or queued again. True
    when that run must be stopped (its user cancelled the job meanwhile)."""
    job.claimed_by = job.claimed_at = None
    session.add(job)
    if external_id is None:
        return False
    moved = record_transition(
        session, job, JobState.submitted, "adopted after a dispatcher restart", external_id=external_id
    )
    return moved is JobState.cancelled


def _tell_fault(session: Session, job: Job, fault: Fault) -> None:
    """Say on the job why its claim cannot be settled; when the bulkhead gives up, fail it (the
    scheduler may hold it: submitting it again could run it twice)."""
    if not fault.gives_up:
        job.reason = fault.reason
        session.add(job)
        return
    job.claimed_by = job.claimed_at = None
    record_transition(session, job, JobState.failed, fault.reason)
