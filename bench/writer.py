"""A busy ledger for the read benchmarks: R commits a second, POSTs and progress updates in turn.

Half the operations are POST /api/v1/jobs through the API (each timed: writers must keep priority
over readers), half move the progress of a running job, committed to the ledger as the reconciler
commits it (an ORM change, stamped by the clock). Paced on a fixed schedule: when an operation runs
late the next starts at once, and the rate reached is reported, not assumed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from sqlalchemy.engine import Engine

from bench.api import JOB_BODY
from service.ledger.clock import read_version_on
from service.ledger.db import make_engine, write_scope
from service.ledger.models import Job


@dataclass
class WriterResult:
    operations_per_s: float
    commits_per_s: float  # the ledger clock's own count: every commit that changed a job
    post_p50_ms: float
    post_p99_ms: float
    posts: int

    def line(self) -> str:
        return (
            f"writer: {self.operations_per_s:.1f} operations/s, {self.commits_per_s:.1f} ledger commits/s, "
            f"{self.posts} POSTs p50 {self.post_p50_ms:.1f} ms p99 {self.post_p99_ms:.1f} ms"
        )


def _percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else 0.0


class Writer:
    """Start with `with Writer(...) as writer:`; `writer.result()` after the block."""

    def __init__(self, url: str, auth: dict[str, str], db: Path, rate: float, running: list[int]) -> None:
        self._url, self._auth, self._db, self._rate, self._running = url, auth, db, rate, running
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-writer")
        self._latencies_ms: list[float] = []
        self._operations = 0
        self._elapsed_s = 0.0
        self._commits = 0

    def __enter__(self) -> Writer:
        if self._rate > 0:
            self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def result(self) -> WriterResult:
        seconds = max(self._elapsed_s, 1e-9)
        return WriterResult(
            self._operations / seconds,
            self._commits / seconds,
            _percentile(self._latencies_ms, 0.5),
            _percentile(self._latencies_ms, 0.99),
            len(self._latencies_ms),
        )

    def _run(self) -> None:
        engine = make_engine(f"sqlite:///{self._db}")
        with httpx.Client(base_url=self._url, headers=self._auth, timeout=30) as client:
            first = _clock(engine)
            started = next_at = time.monotonic()
            while not self._stop.is_set():
                if self._operations % 2 == 0:
                    self._post(client)
                else:
                    self._move_progress(engine, self._running[(self._operations // 2) % len(self._running)])
                self._operations += 1
                next_at += 1 / self._rate
                self._stop.wait(max(0.0, next_at - time.monotonic()))
            self._elapsed_s = time.monotonic() - started
            self._commits = _clock(engine) - first
        engine.dispose()

    def _post(self, client: httpx.Client) -> None:
        began = time.perf_counter()
        client.post(
            "/api/v1/jobs", content=JOB_BODY, headers={"Content-Type": "application/json"}
        ).raise_for_status()
        self._latencies_ms.append((time.perf_counter() - began) * 1000)

    def _move_progress(self, engine: Engine, job_id: int) -> None:
        with write_scope(engine) as session:
            job = session.get(Job, job_id)
            assert job is not None
            step = int((job.progress or {}).get("step", 0)) + 1
            job.progress = {"step": step, "total": 10**6, "metrics": {"loss": 1 / step}}
            session.add(job)


def _clock(engine: Engine) -> int:
    with engine.connect() as connection:
        return read_version_on(connection).seq
