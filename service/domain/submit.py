"""Admission: the whole sequence that turns a POSTed job spec into a stored, queued job.

In order, each step cheaper than the next and none of them counted before it is needed:
1. the request's shape against this service's limits, and the backend it goes to;
2. the operator's policy as far as the request itself tells (entrypoints, scripts, environment, which
   interpreters, who may run uploaded code), and the Unix account the job will run as
   (service.accounts); a script path is resolved once, here;
3. an `Idempotency-Key` retry is answered with the job its first request made, before anything is
   counted: a retry by a user at their limits still gets its job. The job is looked up from the event
   loop (`replayed`: service.api.reader, one read for the retries of a turn): in a worker thread on a
   pooled connection it cost four round trips to PostgreSQL and a thread's handoffs;
4. the user's quotas: the job's size, then the submissions of the minute, then the unfinished jobs.
   From here on the submission has used its slot of the minute, stored or refused: each step below
   costs the service (a process, a read of the store, a scheduler call), and a refusal that gave its
   slot back let a user have them made without end, a new job shape at a time. Only a replay found by
   the intake (the same job answered again) and the ledger's refusal for the unfinished-job count give
   the slot back; any refusal gives back the job's place among the unfinished ones;
5. what the request names, looked at: the interpreter asked what it has, as the job's account
   (service.domain.policy), and the job's code snapshot (the user's own) read for its files;
6. room on disk for the job's folder, and the backend's own validation (`sbatch --test-only` may have
   to be asked: off the event loop, unless the backend says its answer is quick);
7. the intake's group commit, which also settles two first requests with one key racing each other.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from sqlalchemy import String, and_, bindparam, or_
from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.accounts import job_account
from service.backends.base import Backend
from service.config import Settings
from service.domain import code_store, policy, sweeps
from service.domain.auth import Principal
from service.domain.code_store import CodeStore
from service.domain.jobs import JOB_TABLE, JobRowStatement, jobs_found, require_backend
from service.domain.quotas import QuotaBook, TooManyUnfinished
from service.domain.storage import RoomCheck
from service.domain.sweep_trials import check_sweep, trial_jobs, trial_params, trials_field
from service.errors import InvalidRequest, ServiceError
from service.ledger.models.jobs import JobCreate, JobPublic, NewJob
from service.ledger.models.sweeps import JobTemplate, NewSweep, Sweep, SweepCreate
from service.loops.intake import Accepted, JobIntake, SweepAccepted, check_same_request, replay_sweep
from service.loops.intake import Key as Key  # (owner, Idempotency-Key): one job at most for each
from worker.spec import RunSpec

StoredT = TypeVar("StoredT", Accepted, SweepAccepted)
# Fields a job has and a sweep does not: an error naming one of them, in a sweep, is about its `job`.
JOB_ONLY_FIELDS = frozenset(JobTemplate.model_fields) - frozenset(SweepCreate.model_fields)
REPLAY_READ = 64  # (owner, Idempotency-Key) pairs per read at most


@dataclass
class Admission:
    """The parts admission needs, built once by the Runtime."""

    settings: Settings
    engine: Engine
    backends: Mapping[str, Backend]
    quotas: QuotaBook
    room: RoomCheck
    intake: JobIntake
    code: CodeStore
    replayed: Callable[[str, str], Awaitable[JobPublic | None]]  # (owner, key): the job it made

    async def submit(self, payload: JobCreate, user: Principal, idempotency_key: str | None) -> Accepted:
        """Admit and store one job; `replayed` when an earlier request with this key made it."""
        backend_name = check_request(payload, self.settings, self.backends)
        backend = require_backend(self.backends, backend_name)
        payload = await self._apply_policy(payload, user)
        run_as = job_account(user.user, user.unix_user, self.settings)
        row = new_job_row(payload, user.user, backend_name, idempotency_key, run_as=run_as)
        if idempotency_key is not None:
            earlier = await self.replayed(user.user, idempotency_key)
            if earlier is not None:
                check_same_request(earlier, row)
                return Accepted(earlier, replayed=True)
        return await self._count_and_store(
            user, payload, run_as, backend, row, lambda most: self.intake.add(row, most)
        )

    async def submit_sweep(
        self, payload: SweepCreate, user: Principal, idempotency_key: str | None
    ) -> SweepAccepted:
        """Admit and store a sweep with all its trials, as one job's admission does for each of them,
        but with one policy check, one backend validation and one commit; trials count as jobs."""
        check_sweep(payload, self.settings)
        with _under_the_sweeps_job():
            return await self._submit_sweep(payload, user, idempotency_key)

    async def _submit_sweep(
        self, payload: SweepCreate, user: Principal, idempotency_key: str | None
    ) -> SweepAccepted:
        job = await self._apply_policy(payload.job, user)
        assert isinstance(job, JobTemplate)
        payload = payload.model_copy(update={"job": job})
        params = trial_params(payload)
        trials = trial_jobs(payload, params)
        backend_name = check_request(trials[0], self.settings, self.backends)
        backend = require_backend(self.backends, backend_name)
        run_as = job_account(user.user, user.unix_user, self.settings)
        sweep = NewSweep(
            name=payload.name,
            owner=user.user,
            backend=backend_name,
            request=payload.model_dump(mode="json"),
            max_parallel=payload.max_parallel,
            metric=payload.metric,
            goal=payload.goal,
            trials=[
                replace(new_job_row(trial, user.user, backend_name, run_as=run_as), params=one)
                for trial, one in zip(trials, params, strict=True)
            ],
            idempotency_key=idempotency_key,
        )
        if idempotency_key is not None:  # a retry is answered before anything is counted
            earlier = await asyncio.to_thread(find_replayed_sweep, self.engine, user.user, idempotency_key)
            if earlier is not None:
                return replay_sweep(earlier, sweep.request)
        return await self._count_and_store(
            user,
            job,
            run_as,
            backend,
            sweep.trials[0],
            lambda most: self.intake.add_sweep(sweep, most),
            jobs=len(trials),
            jobs_field=trials_field(payload),
        )

    async def _count_and_store(
        self,
        user: Principal,
        job: JobCreate,
        run_as: str,
        backend: Backend,
        first: NewJob,
        store: Callable[[int], Awaitable[StoredT]],
        jobs: int = 1,
        jobs_field: str | None = None,
    ) -> StoredT:
        """Steps 4 to 7 for one submission of `jobs` jobs like `job` (made by the request's
        `jobs_field`): count it against the user's quotas, look at what it names, check the room and
        the backend (with the `first` job), then `store(the user's active-job limit)`. What was
        counted is given back when nothing new was stored, its slot of the minute only for a replay
        or a refusal for the unfinished-job count (the module's step 4)."""
        if self.quotas.needs_refresh(user.user):
            await asyncio.to_thread(self.quotas.refresh, user.user)
        self.quotas.admit(user.user, job.resources, jobs=jobs, jobs_field=jobs_field)
        try:
            await self._look_at_what_it_names(job, user, run_as)
            await self.room.check()
            await self._validate(backend, RunSpec(job_id=0, name=first.name, folder="", **first.spec))
            accepted = await store(self.quotas.limits(user.user).max_active_jobs)
        except TooManyUnfinished:
            self.quotas.release(user.user, jobs=jobs, give_back_slot=True)
            raise
        except BaseException:
            self.quotas.release(user.user, jobs=jobs)
            raise
        if accepted.replayed:
            self.quotas.release(user.user, jobs=jobs, give_back_slot=True)
        else:
            self.quotas.stored(user.user, jobs=jobs)
        return accepted

    async def _apply_policy(self, payload: JobCreate, user: Principal) -> JobCreate:
        """Step 2: what the request itself tells, and a script's real path."""
        policy.check_env(payload.env, self.settings)
        if payload.python is not None:
            policy.check_python_allowed(payload.python, self.settings)
        if payload.code is not None:
            code_store.require_code_permission(user)  # its files are read at step 5
            if payload.script is None or not payload.script.startswith("/"):
                return payload  # a relative script is the snapshot's, found in it by the ranks
        elif payload.entrypoint is not None:
            policy.check_entrypoint_allowed(payload.entrypoint, self.settings)
        if payload.script is None:
            return payload
        script = await asyncio.to_thread(policy.resolve_allowed_script, payload.script, self.settings)
        return payload.model_copy(update={"script": script})  # the real path: no symlink swap later

    async def _look_at_what_it_names(self, job: JobCreate, user: Principal, run_as: str) -> None:
        """Step 5, once the submission is counted: a process, and a read of the code store."""
        if job.python is not None:
            await asyncio.to_thread(policy.check_python_runs_jobs, job.python, run_as)
        if job.code is not None:
            paths = await asyncio.to_thread(self._code_paths, job.code, user)
            policy.check_code_target(job.entrypoint, job.script, paths, self.settings)

    def _code_paths(self, code_id: str, user: Principal) -> frozenset[str]:
        """The files of the user's snapshot `code_id` (404 when not theirs)."""
        with Session(self.engine) as session:
            row = code_store.find(session, user, code_id)
        return frozenset(self.code.paths(row.digest))

    @staticmethod
    async def _validate(backend: Backend, probe: RunSpec) -> None:
        if backend.validate_is_quick(probe):
            backend.validate(probe)
        else:
            await asyncio.to_thread(backend.validate, probe)


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


def check_request(payload: JobCreate, settings: Settings, backends: Mapping[str, Backend]) -> str:
    """Validate what pydantic cannot know (this service's limits, the backend's node limit); return
    the name of the backend the job goes to."""
    res = payload.resources
    limits = [
        ("resources.nodes", res.nodes, settings.max_nodes),
        ("resources.tasks_per_node", res.tasks_per_node, settings.max_tasks_per_node),
        ("resources.gpus_per_node", res.gpus_per_node, settings.max_gpus_per_node),
        ("resources.timeout_min", res.timeout_min, settings.max_timeout_min),
    ]
    for field, value, maximum in limits:
        if value > maximum:
            raise InvalidRequest(f"is {value}, above this service's maximum of {maximum}", field=field)
    name = payload.backend or settings.default_backend
    most = require_backend(backends, name).max_nodes
    if most is not None and res.nodes > most:
        nodes = "one node" if most == 1 else f"at most {most} nodes"
        roomier = sorted(n for n, b in backends.items() if b.max_nodes is None or b.max_nodes >= res.nodes)
        hint = f"; use backend '{roomier[0]}' for more" if roomier else ""
        raise InvalidRequest(f"the {name} backend runs on {nodes}{hint}", field="resources.nodes")
    return name


def new_job_row(
    payload: JobCreate,
    owner: str,
    backend: str,
    idempotency_key: str | None = None,
    *,
    run_as: str | None = None,
) -> NewJob:
    spec = payload.model_dump(exclude={"name", "backend", "retries"}, mode="json")  # what the ranks get
    for optional in ("code", "python"):  # absent rather than null: a job without them reads as before
        if spec[optional] is None:
            del spec[optional]
    return NewJob(
        name=payload.name,
        owner=owner,
        backend=backend,
        spec=spec,
        run_as=run_as,
        idempotency_key=idempotency_key,
        retries=payload.retries.model_dump(mode="json"),
    )


def find_replayed_sweep(engine: Engine, owner: str, key: str) -> Sweep | None:
    with Session(engine) as session:
        return sweeps.find_replayed(session, owner, key)


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
