"""What the dispatcher's claim does differently for a sweep's trials: it alone decides how many of a
sweep's trials go out (max_parallel), and hands a backend nothing it would have to refuse.

- On a backend that runs arrays (SLURM), a sweep's waiting trials are claimed together, whatever the
  batch size, so that they reach the scheduler as one array throttled to the sweep's max_parallel
  (the RunSpec's ArrayGroup says which array and how wide). Past MaxArraySize the backend cuts them
  into several arrays whose throttles share max_parallel, each at least one at a time: so at most
  max_parallel arrays' worth (max_parallel x the backend's array_size()) is claimed; the rest waits,
  unclaimed, for room. While the backend cannot tell its array size yet, the sweep waits a tick.
- On one that does not (local), the dispatcher is the throttle: a sweep with max_parallel trials
  under way gets no more claimed, and its waiting trials are left out of the claim query, so that they
  cannot fill every batch and starve other jobs.
- On an array backend too, once some of a sweep's trials are under way (a trial waiting then is a
  retry, or one past the arrays' worth): its arrays' throttles hold only their own tasks, and a trial
  sent in an array of its own ran beside them, max_parallel + 1 at once. Such trials wait for room as
  on a local backend, and the trials under way count every task the arrays still hold, queued ones
  too, so that the arrays cannot fill the room a retry took.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping, Sequence

from sqlalchemy import ColumnElement, and_, func, not_, or_, true
from sqlalchemy import select as core_select
from sqlalchemy.engine import RowMapping
from sqlmodel import Session, col

from service.backends.base import Backend
from service.ledger.models.jobs import Job
from service.ledger.models.sweeps import Sweep
from service.states import DISPATCHABLE_STATES, TERMINAL_STATE_NAMES, JobState
from worker.spec import ArrayGroup, RunSpec


def under_way() -> ColumnElement[bool]:
    """A trial that counts against max_parallel: neither ended nor waiting unclaimed for dispatch."""
    waiting = and_(col(Job.state).in_([s.value for s in DISPATCHABLE_STATES]), col(Job.claimed_by).is_(None))
    return and_(col(Job.state).not_in(list(TERMINAL_STATE_NAMES)), not_(waiting))


def room_left(
    session: Session, waiting: ColumnElement[bool], backends: Mapping[str, Backend]
) -> dict[int, int]:
    """Sweeps with a max_parallel that have trials `waiting`: how many more of their trials may be
    claimed now (_left).

    Read before the claim's query, to leave full sweeps out of it (not_full); on PostgreSQL a sweep
    committed after this read can still be in the claim's rows, so what is claimed is cut to
    room_now's word (within_room)."""
    waiting_sweeps = (
        core_select(col(Job.sweep_id))
        .where(waiting, col(Job.sweep_id).is_not(None))
        .distinct()
        .scalar_subquery()
    )
    return _room(session, col(Sweep.id).in_(waiting_sweeps), backends)


def room_now(
    session: Session, sweep_ids: Collection[int | None], backends: Mapping[str, Backend]
) -> dict[int, int]:
    """room_left for these sweeps (the claim's rows'), counted after their rows are locked.

    PostgreSQL reads each statement at its own snapshot (READ COMMITTED): a sweep committed between
    room_left's read and the claim's query was claimed whole, max_parallel or not (seen in CI: six
    trials of a sweep of max_parallel 2 at once). Counted here, after the claim's query, every trial
    it holds is seen; and the sweeps' rows locked (in id order) make a second replica's claim wait
    until this one's claims are committed and counted."""
    wanted = [sweep_id for sweep_id in set(sweep_ids) if sweep_id is not None]  # locked in id order below
    if not wanted:
        return {}
    return _room(session, col(Sweep.id).in_(wanted), backends, lock=True)


def _room(
    session: Session, sweeps: ColumnElement[bool], backends: Mapping[str, Backend], lock: bool = False
) -> dict[int, int]:
    query = core_select(col(Sweep.id), col(Sweep.max_parallel), col(Sweep.backend)).where(
        sweeps, col(Sweep.max_parallel).is_not(None)
    )
    if lock:  # NO KEY UPDATE: new jobs naming the sweep (a foreign key's KEY SHARE) are not held up
        query = query.order_by(col(Sweep.id)).with_for_update(key_share=True)
    limits = {sweep_id: (limit, backend) for sweep_id, limit, backend in session.execute(query)}
    if not limits:
        return {}
    counted = (
        core_select(col(Job.sweep_id), func.count())
        .where(col(Job.sweep_id).in_(list(limits)), under_way())
        .group_by(col(Job.sweep_id))
    )
    busy = {sweep_id: count for sweep_id, count in session.execute(counted)}
    return {
        sweep_id: _left(limit or 0, busy.get(sweep_id, 0), backends.get(backend))
        for sweep_id, (limit, backend) in limits.items()
    }


def _left(max_parallel: int, busy: int, backend: Backend | None) -> int:
    """How many more of a sweep's trials may be claimed now, `busy` of them under way."""
    if busy or backend is None or not backend.runs_arrays:
        return max(0, max_parallel - busy)
    size = backend.array_size()  # from memory: the rows are locked
    return max_parallel * size if size is not None else 0


def not_full(room: Mapping[int, int]) -> ColumnElement[bool]:
    """Leave out the trials of sweeps with no room: they would take batch places and be skipped."""
    full = [sweep_id for sweep_id, left in room.items() if left <= 0]
    return or_(col(Job.sweep_id).is_(None), col(Job.sweep_id).not_in(full)) if full else true()


def within_room(rows: Sequence[RowMapping], room: Mapping[int, int]) -> list[RowMapping]:
    """The rows to claim: a throttled sweep's trials only up to its room, in id order."""
    left = dict(room)
    kept: list[RowMapping] = []
    for row in rows:
        sweep_id = row["sweep_id"]
        if sweep_id in left:
            if left[sweep_id] <= 0:
                continue
            left[sweep_id] -= 1
        kept.append(row)
    return kept


def rest_of_sweeps(
    rows: Sequence[RowMapping], backends: Mapping[str, Backend], room: Mapping[int, int]
) -> ColumnElement[bool] | None:
    """For the sweeps on array backends that `rows` holds some of: the condition that selects more of
    their queued trials, in id order, up to the room each has left (all of a sweep without a
    max_parallel), so that each sweep leaves in as few arrays as it can; None when there are none.
    Retries waiting their backoff are the claim query's to judge: only queued trials are added."""
    taken = Counter(row["sweep_id"] for row in rows if _runs_arrays(backends, row["backend"]))
    taken.pop(None, None)
    claimed = [row["id"] for row in rows]
    more: list[ColumnElement[bool]] = []
    for sweep_id, count in taken.items():
        others = and_(col(Job.sweep_id) == sweep_id, col(Job.id).not_in(claimed))
        if sweep_id not in room:
            more.append(others)
        elif room[sweep_id] > count:
            next_ones = (
                core_select(col(Job.id))
                .where(others, col(Job.state) == JobState.queued, col(Job.claimed_by).is_(None))
                .order_by(col(Job.id))
                .limit(room[sweep_id] - count)
            )
            more.append(col(Job.id).in_(next_ones))
    return or_(*more) if more else None


def array_groups(session: Session, sweep_ids: Collection[int]) -> dict[int, ArrayGroup]:
    """The ArrayGroup of each of these sweeps."""
    if not sweep_ids:
        return {}
    query = core_select(col(Sweep.id), col(Sweep.max_parallel)).where(col(Sweep.id).in_(list(sweep_ids)))
    return {
        sweep_id: ArrayGroup(key=f"sweep-{sweep_id}", max_parallel=max_parallel)
        for sweep_id, max_parallel in session.execute(query)
    }


def _runs_arrays(backends: Mapping[str, Backend], name: str) -> bool:
    backend = backends.get(name)
    return backend is not None and backend.runs_arrays


def units(specs: Sequence[RunSpec]) -> list[list[RunSpec]]:
    """The batch as the backend must take it: a job alone, a sweep's array whole."""
    groups: dict[str, list[RunSpec]] = {}
    units: list[list[RunSpec]] = []
    for spec in specs:
        if spec.group is None:
            units.append([spec])
        elif spec.group.key not in groups:
            groups[spec.group.key] = [spec]
            units.append(groups[spec.group.key])
        else:
            groups[spec.group.key].append(spec)
    return units
