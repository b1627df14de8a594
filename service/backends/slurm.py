"""The SLURM backend: sbatch through submitit, one batched status query per interval, scancel.

Every scheduler command goes through one injectable runner (argv list, never a shell) and is counted in
`scheduler_calls`, so tests can fake the command line with recorded output and check "one query per
interval". Nothing talks to the scheduler before the first call: building the backend is free.

Status (poll): one `squeue` for all ids (chunks of POLL_CHUNK); a `sacct` only for ids squeue no longer
knows (ended more than MinJobAge ago, e.g. while the service was down). After squeue fails, or takes
longer than SLOW_CALL_S, poll raises BackendError at once, without a call, until the backoff (2 s,
doubling to 60 s; a slow call holds off for as long as it took) has passed. Raising rather than
returning {} keeps the reconciler from reading silence as "the scheduler forgot these jobs". A failing
sacct (accounting down) only leaves those ids out, under a backoff of its own.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from service.accounts import Account
from service.backends import slurm_parse as parse
from service.backends.base import BackendStatus, SubmitOutcome, is_external_id
from service.backends.job_env import JobEnvironment
from service.backends.slurm_states import UnknownSlurmState, map_slurm_state
from service.backends.slurm_submit import (
    arrays_dir,
    check_argv,
    check_folder,
    group_key,
    sbatch_parameters,
    sbatch_still_running,
    script_is_for,
    script_token,
    share_throttle,
    staged_pickles,
    submit_group,
)
from service.config import Settings
from service.errors import BackendError, InvalidRequest
from service.programs import program
from service.states import is_terminal
from worker.spec import JobFiles, RunSpec, ascii_int

log = logging.getLogger(__name__)

# ids per squeue/sacct/scancel call: a thousand active jobs still cost ONE squeue per interval, and
# 5000 ids (about 60 KB of arguments) stay far below ARG_MAX.
POLL_CHUNK = 5000
COMMAND_TIMEOUT_S = 30.0
SUBMIT_TIMEOUT_S = 120.0  # generous: a timed-out sbatch may still have queued the job
SLOW_CALL_S = 10.0
VERDICT_TTL_S = 60.0  # how long validate() trusts an `sbatch --test-only` answer for one shape
_VERDICT_CACHE_SIZE = 256
_GONE = ("invalid job id specified", "already completing or completed", "job has already finished")


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


class Runner(Protocol):
    def __call__(
        self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        """Run one scheduler command, with `env` as its whole environment (default: scheduler_env())."""
        ...


def run_command(argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None) -> CommandResult:
    """The real runner. Raises OSError (no such command) or subprocess.TimeoutExpired.

    No scheduler command inherits the service's environment: sbatch passes its environment on to the
    job (and may run as the job's account, which can read it while it runs), and no SBATCH_* or
    SQUEUE_* setting of the service's may change what it asked for."""
    done = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
        env=dict(env) if env is not None else scheduler_env(),
    )  # fmt: skip
    return CommandResult(done.returncode, done.stdout, done.stderr)


def scheduler_env() -> dict[str, str]:
    """PATH (where the operator's SLURM commands are), SLURM_CONF (where its configuration is) when
    the service has one, and a locale: all a scheduler command needs."""
    return {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", **slurm_conf()}


def slurm_conf() -> dict[str, str]:
    """The operator's SLURM_CONF, if the service has one: every SLURM command reads it, srun in a job
    too."""
    return {"SLURM_CONF": os.environ["SLURM_CONF"]} if "SLURM_CONF" in os.environ else {}


class Backoff:
    """After a failure, refuse calls for base_s, then twice that, ... up to cap_s."""

    def __init__(self, clock: Callable[[], float], base_s: float = 2.0, cap_s: float = 60.0) -> None:
        self._clock, self._base, self._cap = clock, base_s, cap_s
        self._delay = 0.0
        self._until = 0.0
        self.last_error: str | None = None

    def remaining(self) -> float:
        return max(0.0, self._until - self._clock())

    def failed(self, error: str) -> None:
        self._delay = min(self._cap, max(self._base, self._delay * 2))
        self._until = self._clock() + self._delay
        self.last_error = error

    def slow(self, seconds: float) -> None:
        self._until = self._clock() + min(self._cap, seconds)
        self.last_error = f"the last call took {seconds:.1f} s"

    def succeeded(self) -> None:
        self._delay = self._until = 0.0
        self.last_error = None


class _Refused(Exception):
    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.message = message
        self.transient = transient


WAITING_FOR_ROOM = "not submitted yet: the sweep's first arrays hold all of its max_parallel"


def _unreachable_text(message: str) -> str:
    return f"not submitted, SLURM became unreachable: {message}"


def _left_out(specs: Sequence[RunSpec], text: str) -> list[SubmitOutcome]:
    """Outcomes of jobs not submitted for a passing reason (SLURM unreachable, or a sweep's arrays
    waiting for room): the dispatcher queues them again."""
    return [SubmitOutcome(spec.job_id, error=text, transient=True) for spec in specs]


def _ids(external_ids: Sequence[str]) -> list[str]:
    """The ids to ask about, each once; anything that is not an id's shape is left out (and said)."""
    wanted = list(dict.fromkeys(str(one) for one in external_ids))
    ids = [one for one in wanted if is_external_id(one)]
    if len(ids) < len(wanted):
        log.warning("left out %d value(s) that are no SLURM job id: %r", len(wanted) - len(ids),
                    [one for one in wanted if not is_external_id(one)][:5])
    return ids


def _chunks(items: Sequence[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


class SlurmBackend:
    name = "slurm"
    max_nodes = None  # the partition's limit: sbatch --test-only answers it (validate)
    runs_arrays = True  # a sweep is one job array, throttled with %max_parallel

    def __init__(
        self,
        settings: Settings,
        runner: Runner = run_command,
        clock: Callable[[], float] = time.monotonic,
        programs: Callable[[str], str] = program,
    ) -> None:
        """`programs`: a command's absolute path from its name (service.programs)."""
        self._settings = settings
        self._programs = programs
        self.poll_interval_s = settings.reconcile_interval_s  # every poll is a scheduler command
        self._runner = runner
        self._clock = clock
        self._lock = threading.Lock()
        self.scheduler_calls = 0
        self.controller_backoff = Backoff(clock)
        self.accounting_backoff = Backoff(clock)
        self._max_array_size: int | None = None
        self._verdicts: dict[tuple[tuple[str, Any], ...], tuple[float, str | None]] = {}
        self._wakeup: Callable[[], None] = lambda: None

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
        return self._cached_verdict(group_key(params)) is not None

    def submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        """Equal parameters -> one job array per MaxArraySize jobs. A refused array is retried job by job
        to isolate the refusal. BackendError only while nothing was accepted (the batch can be retried).
        Anything else raised is about a job, not SLURM: the dispatcher then hands the jobs over one by
        one (a sweep's array whole) to find it."""
        if not specs:
            return []
        return self._submit(specs)

    def poll(self, external_ids: Sequence[str]) -> dict[str, BackendStatus]:
        wanted = _ids(external_ids)
        if not wanted:
            return {}
        waiting = self.controller_backoff.remaining()
        if waiting > 0:
            raise BackendError(
                f"not asking SLURM for {waiting:.0f} s more, after: {self.controller_backoff.last_error}"
            )
        records: dict[str, parse.SchedulerRecord] = {}
        for chunk in _chunks(wanted, POLL_CHUNK):
            records.update(self._squeue(chunk))
        missing = [one for one in wanted if one not in records]
        if missing and self.accounting_backoff.remaining() == 0:
            try:
                records.update(self._sacct(missing))
            except BackendError as error:
                log.warning("sacct failed, %d job(s) left for the next poll: %s", len(missing), error)
        return self._statuses(wanted, records)

    def recover(self, folders: Sequence[Path]) -> dict[Path, str | None]:
        """Find jobs whose sbatch ran while their dispatcher died, by the token their staged pickle
        shares with the script path SLURM keeps (see slurm_submit): the pickle gets its final name, so
        the job SLURM already holds runs instead of a second one. One squeue for all the folders."""
        staged = {folder: staged_pickles(JobFiles(folder).submitit) for folder in folders}
        answers: dict[Path, str | None] = {folder: None for folder, found in staged.items() if not found}
        staged = {folder: found for folder, found in staged.items() if found}
        if not staged:
            return answers
        tokens = {one.token for found in staged.values() for one in found}
        in_flight = sbatch_still_running(tokens)  # before squeue: one that ends in between shows there
        known = self._submissions(tokens)
        for folder, found in staged.items():
            submitit = JobFiles(folder).submitit
            match = next(
                (
                    one
                    for one in found
                    if (one.token, one.index) in known
                    and script_is_for(known[(one.token, one.index)].command, submitit, one.index)
                ),
                None,
            )
            if match is not None:
                external_id = known[(match.token, match.index)].job_id
                match.adopt(external_id)
                answers[folder] = external_id
            elif not any(one.token in in_flight for one in found):
                for one in found:  # that sbatch is over and queued nothing that can still run
                    one.discard()
                answers[folder] = None
        return answers

    def disowned(self, named: Mapping[Path, str]) -> set[Path]:
        """One squeue of every job: a named id whose script is not this folder's is another's."""
        if not named:
            return set()
        rows = {row.job_id: row for row in self._every_submission()}
        return {
            folder
            for folder, external_id in named.items()
            if (row := rows.get(external_id)) is not None
            and not script_is_for(row.command, JobFiles(folder).submitit, row.array_index)
        }

    def cancel(self, external_ids: Sequence[str]) -> None:
        """One scancel per POLL_CHUNK ids. Unknown and finished jobs are not an error."""
        for chunk in _chunks(_ids(external_ids), POLL_CHUNK):
            result = self._call([self._programs("scancel"), "--", *chunk], COMMAND_TIMEOUT_S)
            if result.returncode == 0:
                continue
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            if lines and all(any(word in line.lower() for word in _GONE) for line in lines):
                continue
            raise BackendError(f"scancel failed: {parse.sbatch_error(result.stderr)}")

    def log_path(self, folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
        """submitit's `<id>_<rank>_log.out|err`; an array element's id is `<array>_<index>`, and its
        files lie in its own job folder too (see slurm_submit)."""
        return JobFiles(folder).submitit / f"{external_id}_{rank}_log.{stream}"

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        # SLURM tells us nothing by itself; kept for the protocol, the reconciler's interval rules.
        self._wakeup = callback

    def close(self) -> None:
        with self._lock:
            self._verdicts.clear()

    # ---------------------------------------------------------------- commands

    def _call(
        self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        with self._lock:
            self.scheduler_calls += 1
        try:
            return self._runner(argv, timeout_s, env)
        except subprocess.TimeoutExpired as error:
            raise BackendError(f"{os.path.basename(argv[0])} did not answer in {timeout_s:.0f} s") from error
        except OSError as error:
            raise BackendError(f"cannot run {os.path.basename(argv[0])}: {error}") from error

    def _query(self, argv: list[str], backoff: Backoff) -> CommandResult:
        """A status command under a backoff; an unknown id is an empty answer, not an error."""
        started = self._clock()
        try:
            result = self._call(argv, COMMAND_TIMEOUT_S)
        except BackendError as error:
            backoff.failed(str(error))
            raise
        if result.returncode != 0 and "invalid job id" not in result.stderr.lower():
            message = f"{os.path.basename(argv[0])} failed: {parse.sbatch_error(result.stderr)}"
            backoff.failed(message)
            raise BackendError(message)
        elapsed = self._clock() - started
        if elapsed > SLOW_CALL_S:
            backoff.slow(elapsed)
        else:
            backoff.succeeded()
        return result

    def _squeue(self, ids: list[str]) -> dict[str, parse.SchedulerRecord]:
        # `--jobs=<ids>` in one word: squeue's list is optional, so a separate word could be an option.
        squeue = self._programs("squeue")
        argv = [squeue, "-h", "-t", "all", "-r", "-O", parse.SQUEUE_FORMAT, f"--jobs={','.join(ids)}"]
        result = self._query(argv, self.controller_backoff)
        return parse.parse_squeue(result.stdout) if result.returncode == 0 else {}

    def _submissions(self, tokens: set[str]) -> dict[tuple[str, int], parse.Submission]:
        """(script token, array index) -> SLURM's row, for the jobs of these scripts that can still
        run (one that already ended gave up waiting for its pickle)."""
        # Every user's jobs: each job was queued by its owner's account. A token is unique to the
        # service's script, but anyone sees it in squeue: script_is_for checks whose the script is.
        found: dict[tuple[str, int], parse.Submission] = {}
        for row in self._every_submission():
            token = script_token(row.command)
            if token not in tokens:
                continue
            try:
                state, _ = map_slurm_state(row.state)
            except UnknownSlurmState:
                continue
            if not is_terminal(state):
                found[(token, row.array_index)] = row
        return found

    def _every_submission(self) -> list[parse.Submission]:
        """Every job SLURM still shows, each array element on its own, with its script's path."""
        argv = [self._programs("squeue"), "-h", "-t", "all", "-r", "-O", parse.SUBMISSIONS_FORMAT]
        return parse.parse_submissions(self._query(argv, self.controller_backoff).stdout)

    def _sacct(self, ids: list[str]) -> dict[str, parse.SchedulerRecord]:
        # An array whose elements never started is one row "35_[0-3]": ask for the array's own id.
        queried = list(dict.fromkeys(one.split("_", 1)[0] for one in ids))
        records: dict[str, parse.SchedulerRecord] = {}
        for chunk in _chunks(queried, POLL_CHUNK):
            jobs = f"--jobs={','.join(chunk)}"
            argv = [self._programs("sacct"), "-n", "-P", "-X", "-o", parse.SACCT_FORMAT, jobs]
            found = parse.parse_sacct(self._query(argv, self.accounting_backoff).stdout)
            records.update((one, replace(record, left_queue=True)) for one, record in found.items())
        # An array cancelled before any element left the queue can be one row under the array's
        # bare id ("62530", not "62530_[0-99]"), and squeue then lists none of its elements: that row
        # is the word for every element it still held. Without it they would wait here forever.
        for one in ids:
            base, _, index = one.partition("_")
            if index and one not in records and base in records:
                records[one] = records[base]
        return records

    @staticmethod
    def _statuses(wanted: list[str], records: dict[str, parse.SchedulerRecord]) -> dict[str, BackendStatus]:
        statuses: dict[str, BackendStatus] = {}
        for one in wanted:
            record = records.get(one)
            if record is None:
                continue
            try:
                statuses[one] = parse.to_status(record)
            except UnknownSlurmState as error:
                log.warning("job %s: %s; leaving it as it was", one, error)
        return statuses

    def _cached_verdict(self, key: Any) -> tuple[float, str | None] | None:
        """(checked at, refusal or None) while this shape's verdict is younger than VERDICT_TTL_S."""
        with self._lock:
            cached = self._verdicts.get(key)
        return cached if cached is not None and self._clock() - cached[0] < VERDICT_TTL_S else None

    def _verdict(self, params: dict[str, Any]) -> str | None:
        key = group_key(params)
        now = self._clock()
        cached = self._cached_verdict(key)
        if cached is not None:
            return cached[1]
        result = self._call([self._programs("sbatch"), *check_argv(params)], COMMAND_TIMEOUT_S)
        refusal = None if result.returncode == 0 else parse.sbatch_error(result.stderr)
        if refusal is not None and parse.is_transient(refusal):
            raise BackendError(f"cannot reach SLURM to check the request: {refusal}")
        with self._lock:
            if len(self._verdicts) >= _VERDICT_CACHE_SIZE:
                self._verdicts.pop(next(iter(self._verdicts)))
            self._verdicts[key] = (now, refusal)
        return refusal

    def max_array_size(self) -> int:
        """MaxArraySize from `scontrol show config`, read once; an array holds at most this many jobs."""
        if self._max_array_size is None:
            result = self._call([self._programs("scontrol"), "show", "config"], COMMAND_TIMEOUT_S)
            if result.returncode != 0:
                raise BackendError(f"scontrol show config failed: {parse.sbatch_error(result.stderr)}")
            value = ascii_int(parse.parse_config_value(result.stdout, "MaxArraySize") or "")
            self._max_array_size = max(1, value or 1)
        return self._max_array_size

    def _sbatch(self, script: Path, account: Account, environment: Mapping[str, str]) -> str:
        """sbatch as the jobs' account (SLURM's accounting, fair share and limits are then theirs),
        with the jobs' environment as its own: sbatch's default --export=ALL passes exactly that on.
        Not an --export list: any list but ALL makes slurmd load the account's login environment
        first (SLURM_GET_USER_ENV), which costs a login shell before every job starts."""
        try:
            argv = [*account.command_prefix(), self._programs("sbatch"), "--parsable", str(script)]
        except OSError as error:  # setpriv or sbatch is missing: the operator's to fix
            raise _Refused(str(error), transient=False) from error
        try:
            result = self._call(argv, SUBMIT_TIMEOUT_S, environment)
        except BackendError as error:
            raise _Refused(str(error), transient=True) from error
        if result.returncode != 0:
            message = parse.sbatch_error(result.stderr)
            raise _Refused(message, transient=parse.is_transient(message))
        job_id = parse.parse_sbatch_job_id(result.stdout)
        if job_id is None:
            raise _Refused(f"sbatch printed no job id: {result.stdout.strip()!r}", transient=False)
        return job_id

    # ---------------------------------------------------------------- submission

    def _submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        outcomes: list[SubmitOutcome | None] = [None] * len(specs)
        # One sbatch is one account's: jobs go together when their parameters, account, interpreter
        # and array group (a sweep) agree; a sweep's arrays share its max_parallel.
        groups: dict[tuple[str | None, str | None, tuple[tuple[str, Any], ...], str | None], list[int]] = {}
        throttles: dict[str | None, int | None] = {None: None}
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
                throttles[group] = spec.group.max_parallel
            groups.setdefault((spec.run_as, spec.python, group_key(params), group), []).append(index)
        size = self.max_array_size()
        unreachable: str | None = None  # once SLURM stopped answering: what the jobs left out are told
        for (run_as, python, key, group), members in groups.items():
            chunks = [members[start : start + size] for start in range(0, len(members), size)]
            throttles_now = share_throttle(throttles[group], len(chunks))
            for number, chunk in enumerate(chunks):
                chunk_specs = [specs[i] for i in chunk]
                if number >= len(throttles_now):
                    results = _left_out(chunk_specs, WAITING_FOR_ROOM)
                elif unreachable is not None:
                    results = _left_out(chunk_specs, unreachable)
                else:
                    parallelism = throttles_now[number]
                    try:
                        results = self._submit_chunk(chunk_specs, dict(key), run_as, python, parallelism)
                    except _Refused as error:  # nothing of this chunk was queued
                        if not any(o is not None and o.accepted for o in outcomes):
                            raise BackendError(f"SLURM is unreachable: {error.message}") from error
                        # Some jobs of this batch are queued already: raising would lose track of them.
                        unreachable = _unreachable_text(error.message)
                        results = _left_out(chunk_specs, unreachable)
                    else:
                        unreachable = next((o.error for o in results if o.transient), None)
                for index, outcome in zip(chunk, results, strict=True):
                    outcomes[index] = outcome
        return [outcome for outcome in outcomes if outcome is not None]

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
        except Exception as error:  # submitit or the filesystem, not the scheduler
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
        self,
        specs: list[RunSpec],
        params: dict[str, Any],
        run_as: str | None,
        python: str | None,
        parallelism: int | None,
    ) -> list[str]:
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
        )

    @functools.cached_property
    def _job_environment(self) -> JobEnvironment:
        """Built at the first submission (it stages the worker), not when the backend is made."""
        settings = self._settings
        return JobEnvironment.build(
            settings.data_dir, settings.job_interpreter(), settings.job_pythonpath, tools=("srun",)
        )
