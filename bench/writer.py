"""A busy ledger for the read benchmarks: R commits a second, POSTs and progress updates in turn.

Half the operations are POST /api/v1/jobs through the API (each timed: writers must keep priority
over readers), half move the progress of a running job, committed to the ledger as the reconciler
commits it (an ORM change, stamped by the clock). Paced on a fixed schedule: when an operation runs
late the next starts at once, and the rate reached is reported, not assumed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
from sqlalchemy.engine import Engine

from bench.api import JOB_BODY
from service.ledger.clock import read_version_on
from service.ledger.db import make_engine, write_scope
from service.ledger.models.jobs import Job


@dataclass
class WriterResult:
    target_per_s: float  # the rate it was asked for
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
    """Start with `with Writer(...) as writer:`; `writer.result()` after the block.

    Two paced threads, R/2 a second each: one POSTs, one moves progress, so a slow POST delays
    only the POSTs behind it (and shows in their latency), not the progress updates."""

    def __init__(
        self, url: str, auth: dict[str, str], database_url: str, rate: float, running: list[int]
    ) -> None:
        self._rate, self._running = rate, running
        self._stop = threading.Event()
        self._engine = make_engine(database_url)
        self._threads = [
            threading.Thread(target=self._paced, args=(self._posts,), name="bench-posts"),
            threading.Thread(target=self._paced, args=(self._progress,), name="bench-progress"),
        ]
        self._client = httpx.Client(base_url=url, headers=auth, timeout=30)
        self._latencies_ms: list[float] = []  # one per POST
        self._moved = 0  # progress updates
        self._started = self._elapsed_s = 0.0
        self._first_seq = self._commits = 0

    def __enter__(self) -> Writer:
        if self._rate > 0:
            self._first_seq, self._started = _clock(self._engine), time.monotonic()
            for thread in self._threads:
                thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        if self._rate > 0:
            for thread in self._threads:
                thread.join()
            self._elapsed_s = time.monotonic() - self._started
            self._commits = _clock(self._engine) - self._first_seq
        self._client.close()
        self._engine.dispose()

    def result(self) -> WriterResult:
        seconds = max(self._elapsed_s, 1e-9)
        return WriterResult(
            self._rate,
            (len(self._latencies_ms) + self._moved) / seconds,
            self._commits / seconds,
            _percentile(self._latencies_ms, 0.5),
            _percentile(self._latencies_ms, 0.99),
            len(self._latencies_ms),
        )

    def _paced(self, operation: Callable[[int], None]) -> None:
        period, next_at, n = 2 / self._rate, time.monotonic(), 0
        while not self._stop.is_set():
            operation(n)
            n += 1
            next_at += period
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def _posts(self, _: int) -> None:
        self._post(self._client)

    def _progress(self, n: int) -> None:
        self._move_progress(self._engine, self._running[n % len(self._running)])
        self._moved += 1

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
