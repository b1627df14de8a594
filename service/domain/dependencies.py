"""Jobs that run after other jobs: who may name whom, what a waiting job waits for, and when it goes.

A job whose spec has `after` is stored `waiting` with a JobDependency row per job it names. Each
dispatch tick settles the waiting jobs whose dependencies have moved (`settle_waiting`): all met, it
is queued and goes out in that same tick; one that can no longer be met (it ended otherwise: failed,
cancelled, timed out, retries exhausted), it is cancelled with a reason naming that dependency, and
its own dependents follow in the same pass. Only a dependency's final outcome counts: a job retrying
is not ended, so its retries are waited out. The rule itself (`verdict`) is pure.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, exists, insert, or_, select
from sqlalchemy.engine import Engine
from sqlalchemy.orm import aliased
from sqlmodel import Session, col

from service.bulkhead import Bulkhead, Fault
from service.domain.auth import Principal
from service.domain.endings import DEPENDENCY
from service.domain.transitions import record_transition
from service.errors import NotFound
from service.ledger.db import write_scope
from service.ledger.models.jobs import Job
from service.ledger.models.pipelines import Dependency, JobDependency
from service.states import TERMINAL_STATE_NAMES, JobState
from worker.spec import UpstreamJob

# How a dependency must end for `on` (a terminal state not listed leaves it unmet for good).
MEETS: dict[str, frozenset[str]] = {
    "succeeded": frozenset({JobState.succeeded.value}),
    "failed": frozenset({JobState.failed.value, JobState.timeout.value}),
    "ended": TERMINAL_STATE_NAMES,
}
_WORDS = {"succeeded": "succeed", "failed": "fail", "ended": "end"}
SETTLE_BATCH = 500  # waiting jobs looked at per statement; a pass goes on while it moves some
MAX_PASSES = 50  # a chain cancelled down in one tick at most this deep; the next tick goes on


def check_upstream(
    session: Session, user: Principal, after: Sequence[Dependency], field: str = "after"
) -> None:
    """Every job `after` names exists and `user` may see it: else 404 naming `after.<position>` (a job
    of someone else's is as unknown as one that never was)."""
    if not after:
        return
    ids = [dependency.job for dependency in after]
    owners = dict(
        session.connection().execute(select(col(Job.id), col(Job.owner)).where(col(Job.id).in_(ids))).all()
    )
    for position, dependency in enumerate(after):
        owner = owners.get(dependency.job)
        if owner is None or not user.may_see(owner):
            raise NotFound(f"job {dependency.job} not found", field=f"{field}.{position}")


def waiting_reason(after: Iterable[tuple[int, str]]) -> str:
    """What a waiting job waits for, as its reason says it: (job id, on) in order."""
    return "waiting for " + ", ".join(f"job {job_id} to {_WORDS[on]}" for job_id, on in after)


def dependency_rows(job_id: int, after: Sequence[Dependency]) -> list[dict[str, Any]]:
    return [
        {"job_id": job_id, "upstream_id": one.job, "on": one.on, "position": position}
        for position, one in enumerate(after)
    ]


def insert_dependencies(session: Session, rows: list[dict[str, Any]]) -> None:
    if rows:
        session.connection().execute(insert(JobDependency), rows)


@dataclass(frozen=True)
class Upstream:
    """One dependency of a waiting job, as the ledger holds it now."""

    job_id: int
    on: str
    state: str
    name: str


@dataclass(frozen=True)
class Verdict:
    """What becomes of a waiting job: it goes (queued), it is cancelled (why), or it waits on."""

    target: JobState | None  # None: it waits on
    reason: str | None


def verdict(upstream: Sequence[Upstream]) -> Verdict:
    """Queued once every dependency ended as its `on` asks; cancelled, naming the first that ended
    otherwise; else it waits on."""
    for one in upstream:
        if one.state in TERMINAL_STATE_NAMES and one.state not in MEETS[one.on]:
            return Verdict(
                JobState.cancelled,
                f"{DEPENDENCY}{one.job_id} ({one.name}) {one.state}; "
                f"this job needed it to {_WORDS[one.on]}",
            )
    if all(one.state in MEETS[one.on] for one in upstream):
        met = ", ".join(f"job {one.job_id} {one.state}" for one in upstream)
        return Verdict(JobState.queued, f"dependencies met: {met}")
    return Verdict(None, None)


def settle_waiting(session: Session, bulkhead: Bulkhead) -> int:
    """Move the waiting jobs whose dependencies have ended: queued or cancelled (see the module
    docstring), each in a savepoint of its own (a bulkhead). Cancelled ones' dependents are settled in
    the next pass of this same call. Returns how many moved."""
    moved = 0
    for _ in range(MAX_PASSES):
        due = _due(session)
        if not due:
            break
        upstream = _upstream_of(session, due)
        moved_now = 0
        for job_id in due:
            settle = functools.partial(_settle, session, job_id, upstream[job_id])
            outcome = bulkhead.guarded(job_id, settle, session)
            if isinstance(outcome, Fault):
                _after_fault(session, outcome)
            elif outcome:
                moved_now += 1
        moved += moved_now
        if moved_now == 0:
            break
    return moved


def settle_due(engine: Engine, bulkhead: Bulkhead) -> int:
    """The dispatch tick's first step: settle the waiting jobs that move now, if any (a read first, so
    that a tick with nothing to settle takes no write turn: on SQLite, the one write lock). Its own
    transactions; returns how many moved."""
    with Session(engine) as session:
        if not any_due(session):
            return 0
    with write_scope(engine) as session:
        return settle_waiting(session, bulkhead)


def any_due(session: Session) -> bool:
    """Whether a settling pass would move a job: a read, so that a tick with nothing to settle takes
    no write turn (on SQLite, the one write lock every commit waits for)."""
    return bool(_due(session, limit=1))


def _due(session: Session, limit: int | None = None) -> list[int]:
    """Waiting jobs that `verdict` moves now, oldest first: every dependency ended, or one ended in a
    way that cannot meet it. Only those: a job still waiting on a running dependency is not read
    again every tick, and cannot fill a batch that jobs able to move then never reach."""
    upstream = aliased(Job)
    dependency = aliased(JobDependency)
    of_job = and_(col(dependency.job_id) == col(Job.id), col(upstream.id) == col(dependency.upstream_id))
    terminal = sorted(TERMINAL_STATE_NAMES)
    not_ended = exists().where(of_job, col(upstream.state).not_in(terminal))
    unmet = exists().where(
        of_job,
        or_(
            *(
                and_(col(dependency.on) == on, col(upstream.state).in_(sorted(TERMINAL_STATE_NAMES - met)))
                for on, met in MEETS.items()
                if TERMINAL_STATE_NAMES - met
            )
        ),
    )
    query = (
        select(col(Job.id))
        .where(col(Job.state) == JobState.waiting.value, or_(~not_ended, unmet))
        .order_by(col(Job.id))
        .limit(limit or SETTLE_BATCH)
    )
    return [job_id for job_id in session.connection().execute(query).scalars() if job_id is not None]


def _upstream_of(session: Session, job_ids: Sequence[int]) -> dict[int, list[Upstream]]:
    query = (
        select(
            col(JobDependency.job_id),
            col(JobDependency.upstream_id),
            col(JobDependency.on),
            col(Job.state),
            col(Job.name),
        )
        .join(Job, col(Job.id) == col(JobDependency.upstream_id))
        .where(col(JobDependency.job_id).in_(job_ids))
        .order_by(col(JobDependency.job_id), col(JobDependency.position))
    )
    found: dict[int, list[Upstream]] = {job_id: [] for job_id in job_ids}
    for job_id, upstream_id, on, state, name in session.connection().execute(query).all():
        found[job_id].append(Upstream(upstream_id, on, str(state), name))
    return found


def _settle(session: Session, job_id: int, upstream: Sequence[Upstream]) -> bool:
    decided = verdict(upstream)
    if decided.target is None:
        return False
    job = session.get(Job, job_id, with_for_update=True)
    if job is None or job.state != JobState.waiting:  # a user's cancel got there first
        return False
    record_transition(session, job, decided.target, decided.reason)
    return True


def _after_fault(session: Session, fault: Fault) -> None:
    """A job whose settling raised keeps waiting with the fault as its reason; given up, it fails."""
    job = session.get(Job, fault.job_id, with_for_update=True)
    if job is None or job.state != JobState.waiting:
        return
    if fault.gives_up:
        record_transition(session, job, JobState.failed, fault.reason)
    else:
        job.reason = fault.reason
        session.add(job)


def upstream_jobs(session: Session, job_ids: Sequence[int]) -> dict[int, list[UpstreamJob]]:
    """What each of these jobs' dependencies left (state, result, newest checkpoint), in the order
    their `after` named them: what the ranks read as ctx.upstream. One read for a whole claim."""
    found: dict[int, list[UpstreamJob]] = {}
    if not job_ids:
        return found
    query = (
        select(
            col(JobDependency.job_id),
            col(Job.id),
            col(Job.name),
            col(Job.stage),
            col(Job.state),
            col(Job.result),
            col(Job.latest_checkpoint),
        )
        .join(Job, col(Job.id) == col(JobDependency.upstream_id))
        .where(col(JobDependency.job_id).in_(job_ids))
        .order_by(col(JobDependency.job_id), col(JobDependency.position))
    )
    for job_id, upstream_id, name, stage, state, result, checkpoint in session.connection().execute(query):
        found.setdefault(job_id, []).append(
            UpstreamJob(
                job_id=upstream_id,
                name=name,
                stage=stage,
                state=str(state),
                result=result,
                checkpoint=checkpoint,
            )
        )
    return found
