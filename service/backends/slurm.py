"""The SLURM backend: sbatch of our own script, one batched status query per interval, scancel.

The parts, one concept a module: the request and its script (slurm_request, plain data and a pure
function), the commands and their backoff (slurm_commands), status (slurm_status), what a killed
dispatcher leaves and how it is found again (slurm_recovery), the files of a submission and the array
folders (slurm_submit), and submitit's names (submitit_adapter). This module holds them together:
which jobs share an sbatch, and how a refusal is kept to the jobs it is about. Building it is free:
nothing talks to the scheduler before the first call.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from cachetools import TTLCache

from service.accounts import Account
from service.backends import slurm_parse as parse
from service.backends import slurm_status as status
from service.backends.base import BackendStatus, StackRequest, SubmitOutcome
from service.backends.job_env import JobEnvironment
from service.backends.slurm_commands import (
    COMMAND_TIMEOUT_S,
    SUBMIT_TIMEOUT_S,
    Backoff,
    Runner,
    SchedulerCommands,
    run_command,
    slurm_conf,
)
from service.backends.slurm_recovery import Recovery
from service.backends.slurm_request import (
    Options,
    check_argv,
    check_folder,
    group_key,
    sbatch_parameters,
    share_throttle,
)
from service.backends.slurm_submit import arrays_dir, submit_group
from service.config import Settings
from service.errors import BackendError, InvalidRequest
from service.jobfs import log_file
from service.programs import program
from worker.spec import RunSpec, ascii_int

log = logging.getLogger(__name__)

VERDICT_TTL_S = 60.0  # how long validate() trusts an `sbatch --test-only` answer for one shape
_VERDICT_CACHE_SIZE = 256
_GONE = ("invalid job id specified", "already completing or completed", "job has already finished")
# One sbatch is one account's: jobs go together when their account, interpreter, parameters and
# array group (a sweep's key) agree.
_GroupKey = tuple[str | None, str | None, Options, str | None]


class _Refused(Exception):
    """sbatch queued nothing of a chunk; `transient`: SLURM could not be reached (try again later)."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient


def _unreachable_text(message: str) -> str:
    return f"not submitted, SLURM became unreachable: {message}"


def _left_out(specs: Sequence[RunSpec], text: str) -> list[SubmitOutcome]:
    """Outcomes of jobs not submitted because SLURM stopped answering: the dispatcher queues them again."""
    return [SubmitOutcome(spec.job_id, error=text, transient=True) for spec in specs]


class SlurmBackend:
    name = "slurm"
    max_nodes = None  # the partition's limit: sbatch --test-only answers it (validate)
    runs_arrays = True  # a sweep is one job array (one per MaxArraySize), throttled with %max_parallel

    def __init__(
        self,
        settings: Settings,
        runner: Runner = run_command,
        clock: Callable[[], float] = time.monotonic,
        programs: Callable[[str], str] = program,
    ) -> None:
        """`programs`: a command's absolute path from its name (service.programs)."""
        self._settings = settings
        self.poll_interval_s = settings.reconcile_interval_s  # every poll is a scheduler command
        self._clock = clock
        self._commands = SchedulerCommands(runner, clock, programs)
        self._recovery = Recovery(functools.partial(status.every_submission, self._commands))
        self._lock = threading.Lock()
        self._config_lock = threading.Lock()  # one `scontrol show config` at a time
        self._config_backoff = Backoff(clock)
        self._learning: threading.Thread | None = None
        self._max_array_size: int | None = None
        # Each shape's verdict, (a refusal or None,), for VERDICT_TTL_S; guarded by _lock, as
        # cachetools' caches are not thread-safe.
        self._verdicts: TTLCache[Options, tuple[str | None]] = TTLCache(
            _VERDICT_CACHE_SIZE, VERDICT_TTL_S, clock
        )
        self._wakeup: Callable[[], None] = lambda: None

    @property
    def scheduler_calls(self) -> int:
        """Every scheduler command run so far (/metrics, and the tests' "one query per interval")."""
        return self._commands.calls

    @property
    def controller_backoff(self) -> Backoff:
        """How long status queries hold off after squeue failed or was slow (slurm_status)."""
        return self._commands.controller

    # ---------------------------------------------------------------- protocol

    def validate(self, spec: RunSpec) -> None:
        """Ask `sbatch --test-only` (cached per resource shape); raise InvalidRequest with its reason."""
        params = sbatch_parameters(spec.resources, self._settings.slurm_partition)
        refusal = self._verdict(params)
        if refusal is not None:
            field = parse.error_field(refusal, spec.resources.cpus_per_task)
            raise InvalidRequest(f"SLURM refuses this request: {refusal}", field=field)

    def validate_is_quick(self, spec: RunSpec) -> bool:
        """Quick while this resource shape's `sbatch --test-only` verdict is cached."""
        params = sbatch_parameters(spec.resources, self._settings.slurm_partition)
        with self._lock:
            return group_key(params) in self._verdicts

    def array_size(self) -> int | None:
        """MaxArraySize from memory: the dispatcher's claim asks under its row locks
        (service.loops.sweep_claims), where no scheduler call may keep it waiting. Until it is known
        the answer is None, and one `scontrol show config` starts on a thread of its own."""
        with self._lock:
            size = self._max_array_size
            if size is None and self._learning is None and not self._config_backoff.remaining():
                self._learning = threading.Thread(
                    target=self._learn_array_size, name="torchyard-slurm-config", daemon=True
                )
                self._learning.start()
            return size

    def submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        """Equal parameters -> one job array per MaxArraySize jobs; a group's arrays (a sweep's) share
        its max_parallel. A refused array is retried job by job to isolate the refusal. BackendError
        only while nothing was accepted (the batch can be retried). Anything else raised is about a
        job, not SLURM: the dispatcher then hands the jobs over one by one (a sweep's array whole) to
        find it."""
        if not specs:
            return []
        return self._submit(specs)

    def poll(self, external_ids: Sequence[str]) -> dict[str, BackendStatus]:
        return status.poll(self._commands, external_ids)

    def recover(self, folders: Sequence[Path]) -> dict[Path, str | None]:
        """See service.backends.slurm_recovery: one squeue for all the folders."""
        return self._recovery.recover(folders)

    def disowned(self, named: Mapping[Path, str]) -> set[Path]:
        return self._recovery.disowned(named)

    def cancel(self, external_ids: Sequence[str]) -> None:
        """One scancel per POLL_CHUNK ids. Unknown and finished jobs are not an error."""
        for chunk in status.chunks(status.job_ids(external_ids)):
            result = self._commands.call([self._commands.program("scancel"), "--", *chunk], COMMAND_TIMEOUT_S)
            if result.returncode == 0:
                continue
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            if lines and all(any(word in line.lower() for word in _GONE) for line in lines):
                continue
            raise BackendError(f"scancel failed: {parse.sbatch_error(result.stderr)}")

    def signal_stacks(self, job: StackRequest) -> bool:
        """One `scancel --signal=URG -- ID` as the job's account (which may signal only its own jobs):
        every task of the job's steps on every node, the ranks of submitit's srun step; not the shell."""
        ids = status.job_ids([job.external_id])
        if not ids:
            return False
        try:
            argv = [*Account.of_job(job.run_as).command_prefix(), self._commands.program("scancel")]
            result = self._commands.call([*argv, "--signal=URG", "--", *ids], COMMAND_TIMEOUT_S)
        except (OSError, KeyError, BackendError) as error:  # setpriv/scancel missing, account gone, timeout
            log.warning("could not signal SLURM job %s for its stacks: %s", job.external_id, error)
            return False
        if result.returncode != 0:
            log.info("scancel --signal=URG %s: %s", job.external_id, parse.sbatch_error(result.stderr))
        return result.returncode == 0

    def log_path(self, folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
        """submitit's `<id>_<rank>_log.out|err`; an array element's id is `<array>_<index>`, and its
        files lie in its own job folder too (see slurm_submit)."""
        return log_file(folder, external_id, rank, stream)

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        # SLURM tells us nothing by itself; kept for the protocol, the reconciler's interval rules.
        self._wakeup = callback

    def close(self) -> None:
        with self._lock:
            self._verdicts.clear()

    # ---------------------------------------------------------------- what SLURM allows

    def _verdict(self, params: dict[str, Any]) -> str | None:
        key = group_key(params)
        with self._lock:
            known = self._verdicts.get(key)
        if known is not None:
            return known[0]
        argv = [self._commands.program("sbatch"), *check_argv(params)]
        result = self._commands.call(argv, COMMAND_TIMEOUT_S)
        refusal = None if result.returncode == 0 else parse.sbatch_error(result.stderr)
        if refusal is not None and parse.is_transient(refusal):
            raise BackendError(f"cannot reach SLURM to check the request: {refusal}")
        with self._lock:
            self._verdicts[key] = (refusal,)
        return refusal

    def max_array_size(self) -> int:
        """MaxArraySize from `scontrol show config`, read once; an array holds at most this many jobs."""
        with self._config_lock:
            if self._max_array_size is None:
                argv = [self._commands.program("scontrol"), "show", "config"]
                result = self._commands.call(argv, COMMAND_TIMEOUT_S)
                if result.returncode != 0:
                    raise BackendError(f"scontrol show config failed: {parse.sbatch_error(result.stderr)}")
                value = ascii_int(parse.parse_config_value(result.stdout, "MaxArraySize") or "")
                self._max_array_size = max(1, value or 1)
            return self._max_array_size

    def _learn_array_size(self) -> None:
        try:
            self.max_array_size()
            self._config_backoff.succeeded()
        except BackendError as error:
            self._config_backoff.failed(str(error))
            log.warning("cannot read SLURM's MaxArraySize yet: %s", error)
        finally:
            with self._lock:
                self._learning = None

    # ---------------------------------------------------------------- submission

    def _submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        outcomes: list[SubmitOutcome | None] = [None] * len(specs)
        unreachable: str | None = None  # once SLURM stopped answering: what the jobs left out are told
        for members, params, run_as, python, parallelism in self._sbatches(specs, outcomes):
            chunk = [specs[i] for i in members]
            if unreachable is not None:
                results = _left_out(chunk, unreachable)
            else:
                try:
                    results = self._submit_chunk(chunk, params, run_as, python, parallelism)
                except _Refused as error:  # nothing of this chunk was queued
                    if not any(o is not None and o.accepted for o in outcomes):
                        raise BackendError(f"SLURM is unreachable: {error.message}") from error
                    # Some jobs of this batch are queued already: raising would lose track of them.
                    unreachable = _unreachable_text(error.message)
                    results = _left_out(chunk, unreachable)
                else:
                    unreachable = next((o.error for o in results if o.transient), None)
            for index, outcome in zip(members, results, strict=True):
                outcomes[index] = outcome
        return [outcome for outcome in outcomes if outcome is not None]

    def _sbatches(
        self, specs: Sequence[RunSpec], outcomes: list[SubmitOutcome | None]
    ) -> list[tuple[list[int], dict[str, Any], str | None, str | None, int | None]]:
        """The sbatch calls these jobs need, all planned before the first: (their indexes, parameters,
        account, interpreter, `%N`). A job that cannot be prepared gets its outcome here instead."""
        groups: dict[_GroupKey, list[int]] = {}
        max_parallel: dict[str | None, int | None] = {None: None}
        for index, spec in enumerate(specs):
            try:
                params = sbatch_parameters(spec.resources, self._settings.slurm_partition)
                folder = spec.files.submitit
                check_folder(folder)
                os.makedirs(folder, exist_ok=True)  # made at claim already: os, not pathlib, per trial
            except Exception as error:  # this job's: the others go on
                outcomes[index] = SubmitOutcome(spec.job_id, error=f"cannot prepare the job: {error}")
                continue
            group = spec.group.key if spec.group is not None else None
            if spec.group is not None:
                max_parallel[group] = spec.group.max_parallel
            groups.setdefault((spec.run_as, spec.python, group_key(params), group), []).append(index)
        size = self.max_array_size()
        planned = []
        for (run_as, python, key, group), members in groups.items():
            chunks = [members[start : start + size] for start in range(0, len(members), size)]
            throttles = share_throttle(max_parallel[group], len(chunks))
            for chunk, at_once in zip(chunks, throttles, strict=True):
                planned.append((chunk, dict(key), run_as, python, at_once))
        return planned

    def _sbatch(self, script: Path, account: Account, environment: Mapping[str, str]) -> str:
        """sbatch as the jobs' account (SLURM's accounting, fair share and limits are then theirs),
        with the jobs' environment as its own: sbatch's default --export=ALL passes exactly that on.
        Not an --export list: any list but ALL makes slurmd load the account's login environment
        first (SLURM_GET_USER_ENV), which costs a login shell before every job starts."""
        try:
            argv = [*account.command_prefix(), self._commands.program("sbatch"), "--parsable", str(script)]
        except OSError as error:  # setpriv or sbatch is missing: the operator's to fix
            raise _Refused(str(error), transient=False) from error
        try:
            result = self._commands.call(argv, SUBMIT_TIMEOUT_S, environment)
        except BackendError as error:
            raise _Refused(str(error), transient=True) from error
        if result.returncode != 0:
            message = parse.sbatch_error(result.stderr)
            raise _Refused(message, transient=parse.is_transient(message))
        job_id = parse.parse_sbatch_job_id(result.stdout)
        if job_id is None:
            raise _Refused(f"sbatch printed no job id: {result.stdout.strip()!r}", transient=False)
        return job_id

    def _submit_chunk(
        self,
        specs: list[RunSpec],
        params: dict[str, Any],
        run_as: str | None,
        python: str | None,
        parallelism: int | None = None,
    ) -> list[SubmitOutcome]:
        """Outcomes for jobs sharing params, account and interpreter; raises _Refused only when SLURM
        cannot be reached."""
        try:
            ids = self._sbatch_group(specs, params, run_as, python, parallelism)
            return [SubmitOutcome(spec.job_id, external_id=one) for spec, one in zip(specs, ids, strict=True)]
        except _Refused as refusal:
            if refusal.transient:
                raise
            if len(specs) == 1 or parallelism is not None:
                # A throttled array (a sweep's) is not split into single jobs: they would run
                # unthrottled. Its trials end with the scheduler's word instead.
                return [SubmitOutcome(spec.job_id, error=refusal.message) for spec in specs]
            log.info("an array of %d was refused (%s); submitting them one by one", len(specs), refusal)
            return self._submit_one_by_one(specs, params, run_as, python, refusal.message)
        except Exception as error:  # the pickle or the filesystem, not the scheduler
            log.exception("submitting %d job(s) failed", len(specs))
            return [SubmitOutcome(spec.job_id, error=f"submission failed: {error}") for spec in specs]

    def _submit_one_by_one(
        self,
        specs: list[RunSpec],
        params: dict[str, Any],
        run_as: str | None,
        python: str | None,
        array_refusal: str,
    ) -> list[SubmitOutcome]:
        """Each job of a refused array alone, to isolate the refusal. When SLURM stops answering half-way,
        the jobs it queued keep their ids and the rest are left out for a later tick (raises _Refused
        only while none was queued): submitting the queued ones again would run them twice."""
        outcomes: list[SubmitOutcome] = []
        for index, spec in enumerate(specs):
            try:
                outcomes += self._submit_chunk([spec], params, run_as, python)
            except _Refused as passing:
                if not any(outcome.accepted for outcome in outcomes):
                    raise
                return outcomes + _left_out(specs[index:], _unreachable_text(passing.message))
            if index == 0 and outcomes[0].error == array_refusal:  # same parameters, same verdict
                return outcomes + [SubmitOutcome(spec.job_id, error=array_refusal) for spec in specs[1:]]
        return outcomes

    def _sbatch_group(
        self, specs: list[RunSpec], params: dict[str, Any], run_as: str | None, python: str | None,
        parallelism: int | None,
    ) -> list[str]:  # fmt: skip
        account = Account.of_job(run_as)
        job_environment = self._job_environment.with_python(python)
        environment = {**job_environment.variables(account), **slurm_conf()}
        return submit_group(
            specs,
            params,
            arrays_dir=arrays_dir(self._settings.data_dir),
            sbatch=functools.partial(self._sbatch, account=account, environment=environment),
            python=job_environment.python,
            parallelism=parallelism,
            srun=self._commands.program("srun"),
        )

    @functools.cached_property
    def _job_environment(self) -> JobEnvironment:
        """Built at the first submission (it stages the worker), not when the backend is made."""
        settings = self._settings
        return JobEnvironment.build(
            settings.data_dir, settings.job_interpreter(), settings.job_pythonpath, tools=("srun",)
        )
