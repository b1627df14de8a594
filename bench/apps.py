"""The torchyard app as the benchmarks serve it: real API, ledger and dispatch loop, null scheduler.

The null backend accepts every job and never runs anything, so a benchmark measures the service
(validation, group commit, dispatch writes), not torch start-up.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from fastapi import FastAPI

from service.app import create_app
from service.backends.base import BackendStatus, SubmitOutcome
from service.config import Settings
from worker.spec import RunSpec


class NullBackend:
    name = "slurm"
    poll_interval_s = 3600.0  # the ledger under measurement changes only by the bench's own writes
    max_nodes = None
    runs_arrays = True

    def __init__(self) -> None:
        self._ids = itertools.count(1)

    def validate(self, spec: RunSpec) -> None:
        return None

    def validate_is_quick(self, spec: RunSpec) -> bool:
        return True

    def array_size(self) -> int | None:
        return 1001  # SLURM's default MaxArraySize

    def submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        return [SubmitOutcome(job_id=s.job_id, external_id=str(next(self._ids))) for s in specs]

    def poll(self, external_ids: Sequence[str]) -> dict[str, BackendStatus]:
        return {}

    def recover(self, folders: Sequence[Path]) -> dict[Path, str | None]:
        return {folder: None for folder in folders}

    def disowned(self, named: Mapping[Path, str]) -> set[Path]:
        return set()

    def cancel(self, external_ids: Sequence[str]) -> None:
        return None

    def log_path(self, folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
        return folder / f"{external_id}_{rank}_log.{stream}"

    def set_wakeup(self, callback: Callable[[], None]) -> None:
        return None

    def close(self) -> None:
        return None


def torchyard_null() -> FastAPI:
    settings = Settings(default_backend="slurm")
    return create_app(settings, backends={"slurm": NullBackend()})
