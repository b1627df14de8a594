"""How the SLURM backend runs a scheduler command: one injectable runner (argv list, never a shell),
every call counted, each command by its absolute path, status queries under a backoff.

Tests put a fake command line with recorded output in place of the runner (tests/unit/backends/
slurm_fakes.py), and the count is how they check "one query per interval".
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from service.backends import slurm_parse as parse
from service.errors import BackendError

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 30.0
SUBMIT_TIMEOUT_S = 120.0  # generous: a timed-out sbatch may still have queued the job
SLOW_CALL_S = 10.0


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

    @property
    def delay_s(self) -> float:
        """How long the last failure holds calls off."""
        return self._delay

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


class SchedulerCommands:
    """The backend's one door to the scheduler's commands.

    `controller` backs off status queries after squeue fails or is slow (SLOW_CALL_S; a slow call
    holds off for as long as it took); `accounting` does the same for sacct on its own, so that
    accounting down only costs the answers sacct alone gives."""

    def __init__(self, runner: Runner, clock: Callable[[], float], programs: Callable[[str], str]) -> None:
        """`programs`: a command's absolute path from its name (service.programs)."""
        self._runner = runner
        self._clock = clock
        self.program = programs
        self._lock = threading.Lock()
        self.calls = 0
        self.controller = Backoff(clock)
        self.accounting = Backoff(clock)

    def call(
        self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        """Run one command; BackendError when it cannot run or does not answer in time."""
        with self._lock:
            self.calls += 1
        try:
            return self._runner(argv, timeout_s, env)
        except subprocess.TimeoutExpired as error:
            raise BackendError(f"{os.path.basename(argv[0])} did not answer in {timeout_s:.0f} s") from error
        except OSError as error:
            raise BackendError(f"cannot run {os.path.basename(argv[0])}: {error}") from error

    def query(self, argv: list[str], backoff: Backoff) -> CommandResult:
        """A status command under a backoff; an unknown id is an empty answer, not an error."""
        started = self._clock()
        try:
            result = self.call(argv, COMMAND_TIMEOUT_S)
        except BackendError as error:
            self._failed(backoff, str(error))
            raise
        if result.returncode != 0 and "invalid job id" not in result.stderr.lower():
            message = f"{os.path.basename(argv[0])} failed: {parse.sbatch_error(result.stderr)}"
            self._failed(backoff, message)
            raise BackendError(message)
        elapsed = self._clock() - started
        if elapsed > SLOW_CALL_S:
            backoff.slow(elapsed)
        else:
            backoff.succeeded()
        return result

    @staticmethod
    def _failed(backoff: Backoff, error: str) -> None:
        backoff.failed(error)
        # Operators (and the outage test) read the backoff here: each wait twice the one before.
        log.warning("slurm status query failed (%s); next try in %.0f s", error, backoff.delay_s)
