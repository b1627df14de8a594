"""`sweep resume ID --trial N`: a trial that early_stop stopped (ending `pruned`) continued to the
end from its latest checkpoint, as a new job of the sweep.

A new job, not a new attempt of the stopped one: the stopped trial's ending stands as the ledger
wrote it (`cancelled`, kind `pruned`, its rung in the reason), and `cancelled` stays terminal, which
every state list, the pipelines' rules and the notices rely on; re-running is a new job elsewhere in
the service too (a pipeline's retry). The new job is the stopped one's spec, parameters, account and
name (`sweep[N]`), with `resumes` naming the stopped job and its latest checkpoint as the checkpoint
its first attempt starts from (the dispatcher's resume_from, as for any retry). Its run is the one a
trial never stopped would have made, from that checkpoint on: a task that resumes exactly (as
worker.tasks.train does) ends with the same parameters. The sweep shows it in the stopped trial's
place; early stopping judges it no more (service.loops.sweep_pruning).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sqlalchemy import select as core_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from service.config import Settings
from service.domain import audit
from service.domain.auth import Principal
from service.domain.quotas import count_unfinished_of, limits_for, too_many_unfinished
from service.domain.sweeps import get_sweep_row
from service.errors import Conflict, NotFound
from service.ledger.db import write_scope
from service.ledger.models.history import JobAttempt
from service.ledger.models.jobs import Job, JobPublic, NewJob
from service.states import JobState

Insert = Callable[[Session, Sequence[NewJob], int], list[JobPublic]]


def resume_trial(
    engine: Engine, settings: Settings, sweep_id: int, number: int, viewer: Principal, insert: Insert
) -> int:
    """Continue trial `number` of the sweep, which early_stop stopped; the new job's id. NotFound for
    a trial the sweep does not have; Conflict, naming the trial, for one not stopped early;
    TooManyUnfinished when the sweep's owner has as many unfinished jobs as they may (it is a job)."""
    with write_scope(engine) as session:
        sweep = get_sweep_row(session, sweep_id, viewer)
        name = f"{sweep.name}[{number}]"
        stopped = session.scalars(
            core_select(Job)
            .where(col(Job.sweep_id) == sweep_id, col(Job.name) == name)
            .order_by(col(Job.id).desc())
            .limit(1)
            .with_for_update()
        ).first()
        if stopped is None or stopped.id is None:
            raise NotFound(f"sweep {sweep_id} has no trial {number}", field="trial")
        kind = session.scalar(
            core_select(col(JobAttempt.kind))
            .where(col(JobAttempt.job_id) == stopped.id)
            .order_by(col(JobAttempt.attempt).desc())
            .limit(1)
        )
        resumed = session.scalar(core_select(col(Job.id)).where(col(Job.resumes) == stopped.id).limit(1))
        if JobState(stopped.state) is not JobState.cancelled or kind != "pruned" or resumed is not None:
            said = f"{stopped.state}" + (f" ({kind})" if kind else "")
            raise Conflict(
                f"trial {number} (job {stopped.id}) was not stopped early: it is {said}; only a trial "
                "early_stop stopped (ending 'pruned') is resumed",
                field="trial",
            )
        most = limits_for(session, sweep.owner, settings).max_active_jobs
        active = count_unfinished_of(session, [sweep.owner])[sweep.owner]
        if active >= most:
            raise too_many_unfinished(active, most)
        row = NewJob(
            name=stopped.name,
            owner=stopped.owner,
            backend=stopped.backend,
            spec=stopped.spec,
            run_as=stopped.run_as,
            retries=stopped.retries,
            params=stopped.params,
            resumes=stopped.id,
            resume_from=stopped.latest_checkpoint,
        )
        [made] = insert(session, [row], sweep_id)
        audit.record(
            session, viewer.user, "sweep.resume", f"sweep {sweep_id}",
            f"trial={number} job={stopped.id} new_job={made.id} from={stopped.latest_checkpoint}",
        )  # fmt: skip
        return made.id
