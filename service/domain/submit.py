"""Admission: the ordered steps that turn a POSTed job spec (or a sweep) into stored, queued jobs.

One request is one `Request`: what it asked, and what the steps derived from it, each once (the
backend it goes to, the Unix account it runs as, the rows to store). The steps run in the order of
`STEPS`, each cheaper than the next and none of them counted before it is needed, so the order of
refusals is the list's and asking a question once cannot change it:
1. `shape`: the request against this service's limits, and the backend it goes to;
2. `policy`: the operator's policy as far as the request itself tells (entrypoints, scripts,
   environment, which interpreters, who may run uploaded code); a script path is resolved once;
3. `account`: the Unix account the job will run as (service.accounts), and the rows to store;
4. `replay`: an `Idempotency-Key` retry is answered with the job its first request made, before
   anything is counted: a retry by a user at their limits still gets its job (service.domain.storing
   reads it; the store settles two first requests racing each other, in its commit);
   `upstream`: the jobs its `after` names exist and are the user's to see (one read of their ids);
5. `quota`: the job's size, then the submissions of the minute. From here on the submission has used
   its slot of the minute, stored or refused: each step below costs the service (a process, a read of
   the store, a scheduler call), and a refusal that gave its slot back let a user have them made
   without end, a new job shape at a time. Only a replay the store found and the store's refusal for
   the unfinished-job count give the slot back;
6. `named`: what the request names, looked at: the interpreter asked what it has, as the job's
   account (service.domain.policy), and the job's code snapshot (the user's own) read for its files;
7. `room`: room on disk for the job's folder;
8. `backend`: the backend's own validation (`sbatch --test-only` may have to be asked: off the event
   loop, unless the backend says its answer is quick);
then the store (service.loops.intake's group commit, through `Store`), which counts the user's
unfinished jobs in the transaction that stores the new ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.accounts import job_account
from service.backends.base import Backend
from service.config import Settings
from service.domain import code_store, notifications, pipelines, policy, sweeps
from service.domain.auth import Principal
from service.domain.code_store import CodeStore
from service.domain.dependencies import check_upstream
from service.domain.job_request import check_request, new_job_row
from service.domain.jobs import require_backend
from service.domain.pipeline_admission import new_pipeline, stage_job, under_stage
from service.domain.pipeline_graph import check_stages
from service.domain.quotas import QuotaBook, TooManyUnfinished
from service.domain.storage import RoomCheck
from service.domain.storing import Accepted, Store, SweepAccepted, replay, replay_sweep
from service.domain.sweep_search import seeded
from service.domain.sweep_trials import check_sweep, first_params, trial_jobs, trials_field
from service.errors import InvalidRequest, ServiceError
from service.ledger.models.jobs import JobCreate, JobPublic, NewJob
from service.ledger.models.pipelines import Pipeline, PipelineAccepted, PipelineCreate
from service.ledger.models.sweeps import JobTemplate, NewSweep, Sweep, SweepCreate
from worker.spec import RunSpec

# Fields a job has and a sweep does not: an error naming one of them, in a sweep, is about its `job`.
JOB_ONLY_FIELDS = frozenset(JobTemplate.model_fields) - frozenset(SweepCreate.model_fields)


@dataclass
class Request:
    """One submission as admission goes through it: what was asked, and what the steps derived."""

    user: Principal
    job: JobCreate  # the job, or a sweep's template of its trials (a script made real by `policy`)
    key: str | None  # its Idempotency-Key
    sweep: SweepCreate | None = None
    # Derived, once each, by the step named:
    backend: Backend | None = None  # shape
    backend_name: str = ""  # shape
    run_as: str = ""  # account
    row: NewJob | None = None  # account: the job to store (a sweep's: its first trial)
    new_sweep: NewSweep | None = None  # account
    answer: Accepted | SweepAccepted | None = None  # replay: the answer, when it is a retry
    jobs: int = 1  # how many jobs it makes (a sweep's trials)
    jobs_field: str | None = None  # the field that makes them
    counted: bool = False  # quota: its slot of the minute taken

    @property
    def first(self) -> NewJob:
        assert self.row is not None, "the account step makes the rows"
        return self.row


Step = Callable[["Admission", Request], Awaitable[None]]


@dataclass
class Admission:
    """The parts admission needs, built once by the Runtime."""

    settings: Settings
    engine: Engine
    backends: Mapping[str, Backend]
    quotas: QuotaBook
    room: RoomCheck
    store: Store
    code: CodeStore
    replayed: Callable[[str, str], Awaitable[JobPublic | None]]  # (owner, key): the job it made

    async def submit(self, payload: JobCreate, user: Principal, idempotency_key: str | None) -> Accepted:
        """Admit and store one job; `replayed` when an earlier request with this key made it."""
        request = Request(user, payload, idempotency_key)
        answer = await self._admit(request, lambda most: self.store.add(request.first, most))
        assert isinstance(answer, Accepted)
        return answer

    async def submit_sweep(
        self, payload: SweepCreate, user: Principal, idempotency_key: str | None
    ) -> SweepAccepted:
        """Admit and store a sweep with all its trials, as one job's admission does for each of them,
        but with one policy check, one backend validation and one commit; trials count as jobs."""
        check_sweep(payload, self.settings)
        request = Request(user, payload.job, idempotency_key, sweep=payload)
        with _under_the_sweeps_job():
            answer = await self._admit(request, lambda most: self.store.add_sweep(_new_sweep(request), most))
        assert isinstance(answer, SweepAccepted)
        return answer

    async def submit_pipeline(
        self, payload: PipelineCreate, user: Principal, idempotency_key: str | None
    ) -> PipelineAccepted:
        """Admit every stage's job or sweep through the steps one job or sweep goes through (errors
        named under `stages.N`), then store the pipeline whole, in one transaction, or nothing: the
        intake counts all its jobs against the user's unfinished ones at once."""
        order = check_stages(payload.stages)
        if idempotency_key is not None:  # a retry is answered before anything is counted
            earlier = await asyncio.to_thread(find_replayed_pipeline, self.engine, user.user, idempotency_key)
            if earlier is not None:
                return pipelines.replay_pipeline(earlier, payload.model_dump(mode="json"))
        requests: list[Request] = []
        try:
            admitted: list[tuple[int, NewJob | NewSweep]] = []
            for position in order:
                stage = payload.stages[position]
                with under_stage(position, stage):
                    made = await self._admit_stage(stage.name, stage_job(stage), user, requests)
                admitted.append((position, made))
            whole = new_pipeline(payload, admitted, user.user, idempotency_key)
            answer = await self.store.add_pipeline(whole, self.quotas.limits(user.user).max_active_jobs)
        except TooManyUnfinished:
            for request in requests:
                self._give_back(request)
            raise
        if answer.replayed:
            for request in requests:
                self._give_back(request)
        return answer

    async def retry_pipeline(self, pipeline_id: int, start: str, user: Principal) -> None:
        """A `retry --from start`: new jobs for that stage and all after it, copied from the ones they
        replace (admitted once already), counted against the user's unfinished jobs in their commit."""
        if self.quotas.needs_refresh(user.user):
            await asyncio.to_thread(self.quotas.refresh, user.user)
        most = self.quotas.limits(user.user).max_active_jobs
        await self.store.retry_pipeline(pipeline_id, start, user, most)

    async def _admit_stage(
        self, stage: str, asked: JobCreate | SweepCreate, user: Principal, requests: list[Request]
    ) -> NewJob | NewSweep:
        """One stage's job or sweep through every step (no Idempotency-Key: the pipeline's is the key)."""
        if isinstance(asked, SweepCreate):
            if asked.search is not None:  # a stage ends when its jobs have: a search's are made later
                raise InvalidRequest("a pipeline's stage cannot be a search yet: give a grid", field="search")
            check_sweep(asked, self.settings)
            request = Request(user, asked.job, None, sweep=asked)
        else:
            request = Request(user, asked, None)
        requests.append(request)
        with _under_the_sweeps_job() if request.sweep is not None else _as_it_is():
            for step in STEPS:
                await step(self, request)
        if request.new_sweep is not None:
            trials = [replace(trial, stage=stage) for trial in request.new_sweep.trials]
            return replace(request.new_sweep, trials=trials)
        return replace(request.first, stage=stage)

    async def _admit(
        self, request: Request, store: Callable[[int], Awaitable[Accepted | SweepAccepted]]
    ) -> Accepted | SweepAccepted:
        """Every step in order, then the store; a step's refusal (a ServiceError) answers the request."""
        try:
            for step in STEPS:
                await step(self, request)
                if request.answer is not None:
                    return request.answer
            answer = await store(self.quotas.limits(request.user.user).max_active_jobs)
        except TooManyUnfinished:
            self._give_back(request)
            raise
        if answer.replayed:  # the store found the key taken meanwhile: nothing new was made
            self._give_back(request)
        return answer

    def _give_back(self, request: Request) -> None:
        if request.counted:
            self.quotas.give_back_slot(request.user.user)

    # ---------------------------------------------------------------- the steps, in order

    async def _shape(self, request: Request) -> None:
        request.backend_name = check_request(request.job, self.settings, self.backends)
        request.backend = require_backend(self.backends, request.backend_name)

    async def _policy(self, request: Request) -> None:
        """What the request itself tells, and a script's real path."""
        job = request.job
        policy.check_env(job.env, self.settings)
        if job.notify:  # the webhooks' hosts are resolved: off the event loop
            await asyncio.to_thread(notifications.check_notify, job.notify, self.settings)
        if job.python is not None:
            policy.check_python_allowed(job.python, self.settings)
        if job.code is not None:
            code_store.require_code_permission(request.user)  # its files are read by `named`
            if job.script is None or not job.script.startswith("/"):
                return  # a relative script is the snapshot's, found in it by the ranks
        elif job.entrypoint is not None:
            policy.check_entrypoint_allowed(job.entrypoint, self.settings)
        if job.script is not None:
            script = await asyncio.to_thread(policy.resolve_allowed_script, job.script, self.settings)
            request.job = job.model_copy(update={"script": script})  # the real path: no symlink swap later

    async def _account(self, request: Request) -> None:
        user = request.user
        request.run_as = job_account(user.user, user.unix_user, self.settings)
        if request.sweep is None:
            request.row = new_job_row(
                request.job, user.user, request.backend_name, request.key, run_as=request.run_as
            )
            return
        assert isinstance(request.job, JobTemplate)
        sweep = seeded(request.sweep.model_copy(update={"job": request.job}), user.user, request.key)
        params = await asyncio.to_thread(first_params, sweep)  # a search's draws: Optuna's, off the loop
        trials = trial_jobs(sweep, params)
        request.jobs, request.jobs_field = len(trials), trials_field(sweep)
        request.new_sweep = NewSweep(
            name=sweep.name,
            owner=user.user,
            backend=request.backend_name,
            request=sweep.model_dump(mode="json"),
            max_parallel=sweep.max_parallel,
            metric=sweep.metric,
            goal=sweep.goal,
            trials=[
                replace(
                    new_job_row(trial, user.user, request.backend_name, run_as=request.run_as), params=one
                )
                for trial, one in zip(trials, params, strict=True)
            ],
            idempotency_key=request.key,
            search_trials=sweep.search.trials if sweep.search is not None else None,
        )
        request.row = request.new_sweep.trials[0]

    async def _replay(self, request: Request) -> None:
        if request.key is None:
            return
        if request.new_sweep is not None:
            earlier_sweep = await asyncio.to_thread(
                find_replayed_sweep, self.engine, request.user.user, request.key
            )
            if earlier_sweep is not None:
                request.answer = replay_sweep(earlier_sweep, request.new_sweep.request)
            return
        earlier = await self.replayed(request.user.user, request.key)
        if earlier is not None:
            request.answer = replay(earlier, request.first)

    async def _upstream(self, request: Request) -> None:
        if request.job.after:
            await asyncio.to_thread(self._check_upstream, request)

    def _check_upstream(self, request: Request) -> None:
        with Session(self.engine) as session:
            check_upstream(session, request.user, request.job.after)

    async def _quota(self, request: Request) -> None:
        user = request.user.user
        if self.quotas.needs_refresh(user):
            await asyncio.to_thread(self.quotas.refresh, user)
        self.quotas.admit(user, request.job.resources, jobs=request.jobs, jobs_field=request.jobs_field)
        request.counted = True

    async def _named(self, request: Request) -> None:
        """Once the submission is counted: a process, and a read of the code store."""
        job = request.job
        if job.python is not None:
            await asyncio.to_thread(policy.check_python_runs_jobs, job.python, request.run_as)
        if job.code is not None:
            paths = await asyncio.to_thread(self._code_paths, job.code, request.user)
            policy.check_code_target(job.entrypoint, job.script, paths, self.settings)

    async def _room(self, request: Request) -> None:
        await self.room.check()

    async def _backend(self, request: Request) -> None:
        assert request.backend is not None
        first = request.first
        probe = RunSpec(job_id=0, name=first.name, folder="", **first.spec)
        if request.backend.validate_is_quick(probe):
            request.backend.validate(probe)
        else:
            await asyncio.to_thread(request.backend.validate, probe)

    def _code_paths(self, code_id: str, user: Principal) -> frozenset[str]:
        """The files of the user's snapshot `code_id` (404 when not theirs)."""
        with Session(self.engine) as session:
            row = code_store.find(session, user, code_id)
        return frozenset(self.code.paths(row.digest))


STEPS: tuple[Step, ...] = (
    Admission._shape,
    Admission._policy,
    Admission._account,
    Admission._replay,
    Admission._upstream,
    Admission._quota,
    Admission._named,
    Admission._room,
    Admission._backend,
)


def _new_sweep(request: Request) -> NewSweep:
    assert request.new_sweep is not None, "the account step makes the sweep"
    return request.new_sweep


@contextmanager
def _under_the_sweeps_job() -> Iterator[None]:
    """A sweep's job goes through the checks one job's admission makes, and their errors name that
    job's fields: in a sweep's body those are under `job`, so `resources.nodes` is `job.resources.nodes`
    there (the sweep's own fields, the Idempotency-Key and `job` itself are left as they are)."""
    try:
        yield
    except ServiceError as error:
        if error.field is not None and error.field.partition(".")[0] in JOB_ONLY_FIELDS:
            error.field = f"job.{error.field}"
        raise


@contextmanager
def _as_it_is() -> Iterator[None]:
    yield


def find_replayed_sweep(engine: Engine, owner: str, key: str) -> Sweep | None:
    with Session(engine) as session:
        return sweeps.find_replayed(session, owner, key)


def find_replayed_pipeline(engine: Engine, owner: str, key: str) -> Pipeline | None:
    with Session(engine) as session:
        return pipelines.find_replayed(session, owner, key)
