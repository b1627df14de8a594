"""An in-memory Backend for tests of the service's own logic (dispatch, reconcile, API).

It implements service.backends.base.Backend without submitit or processes: it records every call,
answers polls from a script the test sets, and can refuse submissions. It is called from the
service's loop threads, so every method takes a lock.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

from service.backends.base import BackendStatus, StackRequest, SubmitOutcome
from service.errors import BackendError, InvalidRequest
from service.states import EndingKind, JobState
from worker.spec import RunSpec


class FakeBackend:
    """A scriptable backend. External ids are `<name>-<job id>`.

    - `submit_error`: when set, submit() raises BackendError(submit_error) (the whole batch fails).
    - `reject`: job name -> message; submit() refuses those jobs one by one (outcome with an error).
    - `unreachable`: job name -> message; submit() leaves those jobs out for a passing reason (a
      transient outcome, as when the scheduler stops answering half-way through a batch).
    - `refuse_validation`: when set, validate() raises InvalidRequest with it (e.g. too many nodes).
    - `set_status()` / `finish()`: what poll() answers for a job; unscripted jobs answer `default`.
    - `poll_interval_s`: how often the reconciler polls it (the tests' settings use 0.05 s too).
    - `recovered` / `undecided` / `recover_error`: what recover() answers for a job folder (an id the
      scheduler got anyway; a folder it cannot tell yet; BackendError); other folders answer None.
    - `max_array_size`: what array_size() answers where runs_arrays (None: not known yet).
    - `others_jobs`: job folders whose `<id>_submitted.pkl` names another folder's job (disowned(),
      which raises BackendError(recover_error) too).
    """

    def __init__(
        self, name: str = "local", default: JobState = JobState.running, poll_interval_s: float = 0.05
    ) -> None:
        self.name = name
        self.default = default
        self.poll_interval_s = poll_interval_s
        self.max_nodes = 1 if name == "local" else None  # as the real backend of that name declares
        self.runs_arrays = name != "local"
        self.max_array_size: int | None = 1001  # SLURM's default MaxArraySize
        self.submit_error: str | None = None
        self.reject: dict[str, str] = {}
        self.unreachable: dict[str, str] = {}
        self.refuse_validation: str | None = None
        self.submit_calls: list[list[int]] = []
        self.poll_calls: list[list[str]] = []
        self.cancel_calls: list[list[str]] = []
        self.validate_calls = 0
        self.recovered: dict[Path, str] = {}
        self.undecided: set[Path] = set()
        self.recover_error: str | None = None
        self.recover_calls: list[list[Path]] = []
        self.others_jobs: set[Path] = set()
        self.specs: dict[int, RunSpec] = {}
        self._statuses: dict[str, BackendStatus] = {}
        self._lock = threading.Lock()
        self._wakeup: Callable[[], None] = lambda: None
        self.closed = False
        self.stack_calls: list[StackRequest] = []
        # What signal_stacks does besides recording the call (write the ranks' stacks files, say);
        # its answer is signal_stacks' answer. None: answer True.
        self.on_stacks: Callable[[StackRequest], bool] | None = None

    # ---------------------------------------------------------------- scripting

    def external_id(self, job_id: int) -> str:
        return f"{self.name}-{job_id}"

    def set_status(
        self,
        job_id: int,
        state: JobState,
        reason: str | None = None,
        exit_code: int | None = None,
        nodes: str | None = None,
        kind: EndingKind | None = None,
        expected_start: datetime | None = None,
    ) -> None:
        with self._lock:
            self._statuses[self.external_id(job_id)] = BackendStatus(
                state, reason, exit_code, nodes, kind, expected_start
            )
        self._wakeup()

    def finish(self, job_id: int, value: object) -> None:
        """Succeed the way a real job does: rank 0 writes result.json, then the scheduler says done."""
        with self._lock:
            spec = self.specs[job_id]
        spec.files.result.write_text(json.dumps({"attempt": spec.attempt, "value": value}))
        self.set_status(job_id, JobState.succeeded, "completed", 0)

    def write_log(self, job_id: int, rank: int, text: str, stream: str = "out") -> Path:
        with self._lock:
            spec = self.specs[job_id]
        path = self.log_path(Path(spec.folder), self.external_id(job_id), rank, stream)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    @property
    def polled_ids(self) -> int:
        with self._lock:
            return sum(len(call) for call in self.poll_calls)

    # ---------------------------------------------------------------- the Backend protocol

    def validate(self, spec: RunSpec) -> None:
        with self._lock:
            self.validate_calls += 1
        if self.refuse_validation is not None:
            raise InvalidRequest(self.refuse_validation, field="resources")

    def validate_is_quick(self, spec: RunSpec) -> bool:
        return True

    def array_size(self) -> int | None:
        return self.max_array_size if self.runs_arrays else None

    def submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        with self._lock:
            self.submit_calls.append([spec.job_id for spec in specs])
            if self.submit_error is not None:
                raise BackendError(self.submit_error)
            outcomes = []
            for spec in specs:
                if spec.name in self.reject:
                    outcomes.append(SubmitOutcome(job_id=spec.job_id, error=self.reject[spec.name]))
                    continue
                if spec.name in self.unreachable:
                    error = self.unreachable[spec.name]
                    outcomes.append(SubmitOutcome(job_id=spec.job_id, error=error, transient=True))
                    continue
                self.specs[spec.job_id] = spec
                self._statuses.pop(self.external_id(spec.job_id), None)  # a retry starts afresh
                outcomes.append(SubmitOutcome(job_id=spec.job_id, external_id=self.external_id(spec.job_id)))
            return outcomes

    def poll(self, external_ids: Sequence[str]) -> dict[str, BackendStatus]:
        with self._lock:
            self.poll_calls.append(list(external_ids))
            return {
                external_id: self._statuses.get(external_id, BackendStatus(self.default))
                for external_id in external_ids
            }

    def recover(self, folders: Sequence[Path]) -> dict[Path, str | None]:
        with self._lock:
            self.recover_calls.append(list(folders))
            if self.recover_error is not None:
                raise BackendError(self.recover_error)
            return {folder: self.recovered.get(folder) for folder in folders if folder not in self.undecided}

    def disowned(self, named: Mapping[Path, str]) -> set[Path]:
        with self._lock:
            if self.recover_error is not None:
                raise BackendError(self.recover_error)
            return self.others_jobs & set(named)

    def cancel(self, external_ids: Sequence[str]) -> None:
        with self._lock:
            self.cancel_calls.append(list(external_ids))
            for external_id in external_ids:
                current = self._statuses.get(external_id)
                if current is None or current.state not in (JobState.succeeded, JobState.failed):
                    self._statuses[external_id] = BackendStatus(JobState.cancelled, "cancelled")

    def signal_stacks(self, job: StackRequest) -> bool:
        with self._lock:
            self.stack_calls.append(job)
            action = self.on_stacks
        return True if action is None else action(job)

    def log_path(self, folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
        return folder / "submitit" / f"{external_id}_{rank}_log.{stream}"

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        self._wakeup = callback

    def close(self) -> None:
        self.closed = True
