"""What admission hands the store of new jobs, what it hears back, and the one answer to "which job
did this Idempotency-Key make".

Admission (service.domain.submit) decides; the intake (service.loops.intake, a thread that commits
what arrives together) stores. Admission knows the intake only as a `Store`, so the domain never
imports the loops. An Idempotency-Key's job is read by `replay_reads` wherever it is asked: by
admission, which answers a retry before anything is counted (a retry by a user at their limits still
gets its job), and by the intake in the commit that stores, which settles two first requests with
one key racing each other and a key another replica stored meanwhile.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy import String, and_, bindparam, or_

from service.domain.auth import Principal
from service.domain.jobs import JOB_TABLE, JobRowStatement, jobs_found
from service.errors import Conflict
from service.ledger.models.jobs import JobPublic, NewJob
from service.ledger.models.pipelines import NewPipeline, PipelineAccepted
from service.ledger.models.sweeps import NewSweep, Sweep, SweepPublic

Key = tuple[str, str]  # (owner, Idempotency-Key): one job, or one sweep, at most for each
REPLAY_READ = 64  # (owner, Idempotency-Key) pairs per read at most


@dataclass(frozen=True)
class Accepted:
    job: JobPublic
    replayed: bool  # True: an Idempotency-Key retry, answered with the job the first request made


@dataclass(frozen=True)
class SweepAccepted:
    sweep_id: int
    replayed: bool  # True: an Idempotency-Key retry, answered with the sweep the first request made
    made: SweepPublic | None = None  # the sweep as this request stored it (None for a replay)


class Store(Protocol):
    """Where admitted jobs go. `max_active`: the owner may have at most this many unfinished jobs,
    counted in the transaction that stores them (TooManyUnfinished past it)."""

    async def add(self, row: NewJob, max_active: int | None = None) -> Accepted: ...

    async def add_sweep(self, sweep: NewSweep, max_active: int | None = None) -> SweepAccepted: ...

    async def add_pipeline(
        self, pipeline: NewPipeline, max_active: int | None = None
    ) -> PipelineAccepted: ...

    async def retry_pipeline(
        self, pipeline_id: int, start: str, viewer: Principal, max_active: int | None = None
    ) -> None: ...


def check_same_request(existing: JobPublic, row: NewJob) -> None:
    """A retry must be the same request: one key reused for a different job is the caller's bug."""
    retries = existing.retries.model_dump(mode="json") if existing.retries is not None else None
    asked = (row.name, row.backend, row.spec, row.retries)
    if (existing.name, existing.backend, existing.spec, retries) != asked:
        raise Conflict(
            f"this Idempotency-Key was already used for a different request (job {existing.id})",
            field="Idempotency-Key",
        )


def replay(earlier: JobPublic, row: NewJob) -> Accepted:
    """The answer to a retry of the request that made `earlier`; Conflict when it is another request."""
    check_same_request(earlier, row)
    return Accepted(earlier, replayed=True)


def replay_sweep(earlier: Sweep, request: dict[str, Any]) -> SweepAccepted:
    """The answer to a retry of the request that made `earlier`; Conflict when it is another request."""
    if earlier.request != request:
        raise Conflict(
            f"this Idempotency-Key was already used for a different sweep (sweep {earlier.id})",
            field="Idempotency-Key",
        )
    assert earlier.id is not None
    return SweepAccepted(earlier.id, replayed=True)


def replay_reads(keys: Iterable[Key]) -> Iterator[tuple[JobRowStatement, dict[str, str]]]:
    """The statements (and their values) that read the jobs earlier requests with these keys made,
    whole (rows for `replays_found`): indexed reads of REPLAY_READ keys at most, each a power of two
    in size (the last key fills), so that a few statements, built once, serve every count."""
    ordered = sorted(set(keys))
    for start in range(0, len(ordered), REPLAY_READ):
        chunk = ordered[start : start + REPLAY_READ]
        size = 1 << (len(chunk) - 1).bit_length()
        values: dict[str, str] = {}
        for index in range(size):
            values[f"owner{index}"], values[f"key{index}"] = chunk[min(index, len(chunk) - 1)]
        yield _replay_statement(size), values


@functools.cache
def _replay_statement(size: int) -> JobRowStatement:
    """Every column of the jobs with up to `size` (owner, Idempotency-Key) pairs (replay_reads)."""
    owner, key = JOB_TABLE.c.owner, JOB_TABLE.c.idempotency_key
    pairs = [
        and_(owner == bindparam(f"owner{n}", type_=String), key == bindparam(f"key{n}", type_=String))
        for n in range(size)
    ]
    return JOB_TABLE.select().where(or_(*pairs))


def replays_found(rows: Iterable[Sequence[Any]]) -> dict[Key, JobPublic]:
    """The jobs replay_reads read, by their (owner, Idempotency-Key)."""
    return {(job["owner"], job["idempotency_key"]): JobPublic.model_validate(job) for job in jobs_found(rows)}
