"""The Backend protocol: the only door to submitit and the schedulers behind it.

Every call is batched: one submit for many jobs, one status query for all active jobs.
Backends map the scheduler's states to JobState themselves and keep the scheduler's own words in
`reason`. Exceptions from submitit or the scheduler leave a backend only as BackendError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

from service.states import EndingKind, JobState
from worker.spec import RunSpec


@dataclass(frozen=True)
class SubmitOutcome:
    """What became of one job handed to submit(): an external id, or the backend's refusal."""

    job_id: int
    external_id: str | None = None
    error: str | None = None
    transient: bool = False  # not submitted for a passing reason (the scheduler unreachable): try again

    @property
    def accepted(self) -> bool:
        return self.external_id is not None


@dataclass(frozen=True)
class BackendStatus:
    """The scheduler's view of one job, already mapped to our states.

    A terminal state here is the scheduler's word only: the reconciler confirms it against the job
    folder (rank 0's result, the ranks' error files) before it reaches the ledger.
    """

    state: JobState
    reason: str | None = None  # pending reason, scheduler state word, signal ...
    exit_code: int | None = None
    nodes: str | None = None  # where it runs, when known
    kind: EndingKind | None = None  # for an ending the scheduler can name (node failure, OOM, ...)
    expected_start: datetime | None = None  # while it waits: when the scheduler expects to start it
    lost_batch_host: str | None = None  # SLURM ended the allocation because it lost this, its batch host


@dataclass(frozen=True)
class StackRequest:
    """What a backend needs to have one job's ranks write their stacks (service.domain.capture): the
    job's run, the Unix account it runs as (the signal is sent as that account, never as the service),
    and its interpreter (what a local signaller runs: the one program the account surely may)."""

    external_id: str
    run_as: str | None = None
    python: str | None = None


@runtime_checkable
class Backend(Protocol):
    """What differs between backends is declared here (interval, node limit, how quick validation is),
    so the loops and the admission never test a backend's name."""

    name: str

    @property
    def poll_interval_s(self) -> float:
        """How often the reconcile loop asks this backend about its jobs, in seconds."""
        ...

    @property
    def runs_arrays(self) -> bool:
        """True: jobs of one ArrayGroup handed over together become one scheduler array (one per
        array_size() jobs, their throttles sharing its max_parallel). False: the dispatcher holds them
        back to max_parallel. Either way the dispatcher's claim decides how many go out
        (service.loops.sweep_claims); a backend submits what it is handed."""
        ...

    def array_size(self) -> int | None:
        """The most jobs one scheduler array holds, from memory: the claim asks it under its row
        locks, so it never waits on the scheduler. None while not known yet (a backend that reads it
        from its scheduler starts finding out), and where runs_arrays is False."""
        ...

    @property
    def max_nodes(self) -> int | None:
        """The most nodes one job can span here; None: the scheduler decides (validate asks it)."""
        ...

    def validate(self, spec: RunSpec) -> None:
        """Raise InvalidRequest when the scheduler could never run this request (checked at POST)."""

    def validate_is_quick(self, spec: RunSpec) -> bool:
        """True when validate(spec) answers from memory (no command, no file), so the POST route may
        call it on the event loop instead of paying a thread hop."""
        ...

    def submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        """Hand many jobs over at once; one outcome per spec, in order. Never raises for one bad job."""
        ...

    def poll(self, external_ids: Sequence[str]) -> dict[str, BackendStatus]:
        """ONE batched status query for all these jobs. Ids the scheduler no longer knows may be absent."""
        ...

    def recover(self, folders: Sequence[Path]) -> dict[Path, str | None]:
        """For job folders whose dispatcher died during submit, with no `<id>_submitted.pkl`: the id of
        the job the scheduler got anyway (made whole, so that it runs), or None when it surely has
        none (safe to submit again). A folder left out cannot be told yet (a submission may still be
        in flight): keep its claim. Raises BackendError when the scheduler cannot be asked."""
        ...

    def disowned(self, named: Mapping[Path, str]) -> set[Path]:
        """Of these job folders, each with the id its `<id>_submitted.pkl` names: those whose id the
        scheduler shows as another folder's job. The job's account can rename a file the service
        made there to any name, and a dispatcher that died would then adopt someone else's job (poll
        it, cancel it as root). An id the scheduler no longer shows is not among them: an ended job
        harms no one. Raises BackendError when the scheduler cannot be asked."""
        ...

    def cancel(self, external_ids: Sequence[str]) -> None:
        """Stop these jobs. Idempotent: cancelling a finished or unknown job is not an error."""

    def signal_stacks(self, job: StackRequest) -> bool:
        """SIGURG to every rank of this running job, sent as the job's own account (each rank dumps its
        threads' stacks into its stacks file on it: worker.stacks). One call per job, however many
        ranks. True when the signal went out; False when the job is not (or no longer) running here or
        the scheduler refused. Never raises for a job that ended meanwhile."""
        ...

    def log_path(self, folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
        """Where submitit writes this rank's stdout ("out") or stderr ("err")."""
        ...

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        """Register a callback the backend calls when it knows a job changed (reconcile at once)."""

    def close(self) -> None:
        """Release threads and handles; running jobs keep running."""
