"""A search's part of the reconcile loop: after each tick, each search sweep on the backend with
trials still to make and room under its max_parallel gets its next trials, drawn from the trials
that ended (service.domain.sweep_search), stored as the intake stores a sweep's trials
(`insert`), and the dispatcher woken; they go to the backend as a grid's trials do
(service.loops.sweep_claims: throttled to max_parallel, on SLURM the first wave one array).

Room is counted against the trials that have not ended (queued ones too): so at most max_parallel
of a search's trials exist unfinished at once, and TPE learns from every trial that ended before
the next was made. The sweep's row is locked while its new trials are stored, and they are stored only
when `size` is still what the draws were made from, so that two replicas, or a pass and a restarted
service, never make a trial number twice: what the ledger holds (`size`) says which number is next.

A pass reads one query for the open searches of the backend (`search_trials` above `size`), one
for how many of their trials are unfinished, and grows at most MAX_SWEEPS_PER_OWNER sweeps of each
owner, those grown least recently first (fair share), drawing for about DRAW_BUDGET_S at most so
that the reconcile tick it follows is not held up; one sweep's fault costs that sweep's growth for
this pass, never the pass.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from sqlalchemy import func
from sqlalchemy import select as core_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from service.domain.job_request import new_job_row
from service.domain.sweep_search import Ended, Params, next_params
from service.domain.sweep_trials import trial_jobs
from service.domain.sweeps import trials_of
from service.ledger.db import session_scope, write_scope
from service.ledger.models.jobs import Job, JobPublic, NewJob
from service.ledger.models.sweeps import Sweep, SweepCreate
from service.states import TERMINAL_STATE_NAMES, JobState

log = logging.getLogger(__name__)

MAX_SWEEPS_PER_OWNER = 4  # grown in one pass; the others in the next passes, in turn
LOOK_EVERY_S = 30.0  # a still tick's look for trials that ended outside the loop
DRAW_BUDGET_S = 1.0  # a pass's draws stop past this (each sweep makes one at least): the tick goes on

Insert = Callable[[Session, Sequence[NewJob], int], list[JobPublic]]


class SweepSearch:
    """Grows the open searches after each reconcile tick. `insert(session, rows, sweep_id)` is the
    intake's insert of a sweep's trials; `wake()` the dispatcher's."""

    def __init__(self, engine: Engine, insert: Insert, wake: Callable[[], None]) -> None:
        self._engine = engine
        self._insert = insert
        self._wake = wake
        self._passes = 0
        self._grown: dict[int, int] = {}  # sweep id -> the pass that last grew it
        self._next_look: dict[str, float] = {}  # backend -> when a still tick looks all the same

    def after_tick(self, backend_name: str, *, moved: bool = True) -> int:
        """Make the next trials of the open searches with room. Returns how many were made.

        A tick in which no watched job moved ended no trial: it looks for none (a still queue costs
        the tick one statement), but for one look every LOOK_EVERY_S, for trials that ended elsewhere
        (a user's cancel, a refused submission) and a service's first tick."""
        now = time.monotonic()
        if not moved and now < self._next_look.get(backend_name, 0.0):
            return 0
        self._next_look[backend_name] = now + LOOK_EVERY_S
        self._passes += 1
        deadline = time.monotonic() + DRAW_BUDGET_S
        made = 0
        for sweep_id in self._due(backend_name):
            if time.monotonic() >= deadline:
                break  # the rest in the next passes, first (they were grown least recently)
            self._grown[sweep_id] = self._passes
            try:
                made += self.grow(sweep_id, deadline)
            except Exception:  # this sweep's bad data costs its growth this pass, not the others'
                log.exception("sweep %s: the search could not make its next trials", sweep_id)
        if made:
            self._wake()
        return made

    def _due(self, backend_name: str) -> list[int]:
        """The open searches of the backend with room, at most MAX_SWEEPS_PER_OWNER of each owner,
        those grown least recently first."""
        with session_scope(self._engine) as session:
            open_ = session.execute(
                core_select(col(Sweep.id), col(Sweep.owner), col(Sweep.max_parallel)).where(
                    col(Sweep.backend) == backend_name,
                    col(Sweep.search_trials).is_not(None),
                    col(Sweep.size) < col(Sweep.search_trials),
                )
            ).all()
            if not open_:
                return []
            unfinished = dict(
                session.execute(
                    core_select(col(Job.sweep_id), func.count())
                    .where(col(Job.sweep_id).in_([row[0] for row in open_]),
                           col(Job.state).not_in(list(TERMINAL_STATE_NAMES)))
                    .group_by(col(Job.sweep_id))
                ).all()
            )  # fmt: skip
        with_room = [
            (sweep_id, owner) for sweep_id, owner, limit in open_
            if limit is None or unfinished.get(sweep_id, 0) < limit
        ]  # fmt: skip
        taken: dict[str, int] = {}
        chosen: list[int] = []
        for sweep_id, owner in sorted(with_room, key=lambda row: (self._grown.get(row[0], 0), row[0])):
            if taken.get(owner, 0) < MAX_SWEEPS_PER_OWNER:
                taken[owner] = taken.get(owner, 0) + 1
                chosen.append(sweep_id)
        return chosen

    def grow(self, sweep_id: int, deadline: float = math.inf) -> int:
        """Make the sweep's next trials, as many as its room and its budget allow (at least one, more
        while `deadline` is ahead). The draws are made from a read, outside the write transaction (TPE
        over a thousand trials takes half a second a draw); the write locks the sweep's row and stores
        them only if no trial was made since that read. Returns how many were made."""
        with session_scope(self._engine) as session:
            sweep = session.get(Sweep, sweep_id)
            if sweep is None or sweep.search_trials is None:
                return 0
            request = SweepCreate.model_validate(sweep.request)
            assert request.search is not None
            trials = trials_of(session, sweep)
            first = core_select(col(Job.run_as)).where(col(Job.sweep_id) == sweep_id).limit(1)
            run_as = session.scalar(first)  # the account the first wave runs as (admission chose it)
            owner, backend, goal, size = sweep.owner, sweep.backend, sweep.goal, sweep.size
            unfinished = sum(1 for trial in trials if trial.state.value not in TERMINAL_STATE_NAMES)
            room = (sweep.max_parallel or sweep.search_trials) - unfinished
            count = min(room, sweep.search_trials - len(trials))
        if count <= 0 or size != len(trials):
            return 0
        ended = [
            Ended(
                trial.params,
                trial.metric_last,
                complete=trial.state is JobState.succeeded,
                pruned_at=trial.steps if trial.ending == "pruned" else None,
            )
            for trial in trials
            if trial.state.value in TERMINAL_STATE_NAMES
        ]
        params: list[Params] = []
        for number in range(size, size + count):
            if params and time.monotonic() >= deadline:
                break  # the rest in a later pass, from a history that may have grown
            params.append(next_params(request.search, goal, ended, number))
        rows = [
            replace(new_job_row(job, owner, backend, run_as=run_as), params=one)
            for job, one in zip(trial_jobs(request, params, start=size), params, strict=True)
        ]
        with write_scope(self._engine) as session:
            # NO KEY UPDATE, as the dispatcher's room_now takes it: the new trials' foreign keys take KEY
            # SHARE of this row, which a plain FOR UPDATE held elsewhere would deadlock with (seen on
            # PostgreSQL); two passes growing the sweep still wait for each other here.
            locked = session.get(Sweep, sweep_id, with_for_update={"key_share": True})
            if locked is None or locked.size != size:
                return 0  # another pass (a replica's) made trials since the read: the next pass sees them
            self._insert(session, rows, sweep_id)
            locked.size = size + len(rows)
            session.add(locked)
        log.info("sweep %s: made trials %s to %s", sweep_id, size, size + len(rows) - 1)
        return len(rows)
