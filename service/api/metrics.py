"""Prometheus metrics: what the ledger and the loops say at scrape time, and API latency by route.

Job counts are read from the ledger when Prometheus scrapes (one GROUP BY), not kept in counters the
code must remember to update: the ledger is the truth, and several replicas then agree. Loop timings
and query counts come from the Dispatcher / Reconciler / backends this process runs. Job folder sizes
are the ones stored by the housekeeping loop (no folder is walked at scrape time), summed: any token
may read these, so they name no job (an admin finds the largest through GET /api/v1/folders); the
data directory's free space is one statvfs.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from sqlmodel import Session
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.domain import goodput, jobs, retention
from service.ledger.clock import read_version
from service.states import JobState

if TYPE_CHECKING:
    from service.runtime import Runtime

__all__ = ["CONTENT_TYPE_LATEST", "LatencyMiddleware", "ServiceMetrics"]

# Seconds; the API answers in milliseconds, a slow database in seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ServiceMetrics:
    """One registry per app (tests build many apps in one process; the global registry would clash)."""

    def __init__(self, runtime: Callable[[], Runtime | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.request_seconds = Histogram(
            "torchyard_http_request_duration_seconds",
            "API request latency by route template (not raw path: ids would explode the label set).",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(LedgerCollector(runtime))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LedgerCollector:
    """Collected at scrape time from the running Runtime (nothing when the app is not started)."""

    def __init__(self, runtime: Callable[[], Runtime | None]) -> None:
        self._runtime = runtime

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily: describing would query the ledger at registration

    def collect(self) -> Iterable[Metric]:
        runtime = self._runtime()
        if runtime is None:
            return []
        return [*self._jobs(runtime), *self._loops(runtime), *self._disk(runtime)]

    @staticmethod
    def _jobs(runtime: Runtime) -> Iterable[Metric]:
        with Session(runtime.engine) as session:
            counts = jobs.count_by_state_and_backend(session)
            changes = read_version(session).seq
            kept, restarts = goodput.totals(session)
        family = GaugeMetricFamily(
            "torchyard_jobs", "Jobs in the ledger by state and backend.", labels=["state", "backend"]
        )
        backends = sorted(set(runtime.backends) | {backend for _, backend in counts})
        for backend in backends:
            for state in JobState:  # zeros too: a series that vanishes reads as "no data", not 0
                family.add_metric([state.value, backend], counts.get((state.value, backend), 0))
        yield family
        yield CounterMetricFamily(
            "torchyard_ledger_changes", "Committed transactions that changed a job.", value=changes
        )
        parts = GaugeMetricFamily(
            "torchyard_job_goodput_seconds",
            "Every job's wall time by part (training kept, restart downtime, recomputed work, queue "
            "wait), summed as each job's goodput was last worked out (at its starts, ends and restarts).",
            labels=["part"],
        )
        for part, seconds in kept.items():
            parts.add_metric([part], seconds)
        yield parts
        yield GaugeMetricFamily(
            "torchyard_job_restarts", "Restarts in place of every job in the ledger, summed.", value=restarts
        )

    @staticmethod
    def _loops(runtime: Runtime) -> Iterable[Metric]:
        yield CounterMetricFamily(
            "torchyard_job_renderings_reused",
            "Jobs answered (alone or on a list page) with their JSON already rendered for that version.",
            value=runtime.fragments.hits,
        )
        yield CounterMetricFamily(
            "torchyard_job_renderings",
            "Jobs read whole and rendered, for a version not rendered yet (or no longer kept).",
            value=runtime.fragments.misses,
        )
        yield GaugeMetricFamily(
            "torchyard_long_polls_waiting",
            "Requests held open waiting for a job to change (GET /api/v1/jobs/{id}?wait_s=).",
            value=runtime.job_watch.waiters(),
        )
        yield GaugeMetricFamily(
            "torchyard_stack_captures_under_way",
            "Stacks captures queued or running (service.domain.captures), for requests and the watchdog.",
            value=runtime.captures.under_way(),
        )
        yield GaugeMetricFamily(
            "torchyard_nodes_unprotected_hardlinks",
            "Nodes whose ranks said fs.protected_hardlinks is not 1 there, since start (their placement "
            "files; the log names them).",
            value=runtime.reconciler.hardlinks.unprotected(),
        )
        yield GaugeMetricFamily(
            "torchyard_dispatch_last_duration_seconds",
            "How long the last dispatch tick took.",
            value=runtime.dispatcher.last_duration_s,
        )
        reconcile = GaugeMetricFamily(
            "torchyard_reconcile_last_duration_seconds",
            "How long the last reconcile tick with work took, per backend.",
            labels=["backend"],
        )
        polls = CounterMetricFamily(
            "torchyard_reconcile_polls",
            "Batched status queries the reconcile loop made (one per tick with active jobs).",
            labels=["backend"],
        )
        scheduler = CounterMetricFamily(
            "torchyard_scheduler_calls",
            "Commands run against the scheduler (squeue, sacct, sbatch, scancel ...), where counted.",
            labels=["backend"],
        )
        for name, backend in sorted(runtime.backends.items()):
            reconcile.add_metric([name], runtime.reconciler.last_duration_s.get(name, 0.0))
            polls.add_metric([name], runtime.reconciler.ticks.get(name, 0))
            calls = getattr(backend, "scheduler_calls", None)
            if isinstance(calls, int):
                scheduler.add_metric([name], calls)
        yield reconcile
        yield polls
        yield scheduler
        faults = CounterMetricFamily(
            "torchyard_job_faults",
            "Unexpected errors on one job's part of a loop's pass, which cost that job (its reason says "
            "why; after a few in a row it fails), never the pass.",
            labels=["step"],
        )
        reconciler = runtime.reconciler
        for guard in (runtime.dispatcher.bulkhead, reconciler.bulkhead, reconciler.watch_bulkhead,
                      runtime.housekeeper.bulkhead):  # fmt: skip
            faults.add_metric([guard.step], guard.faults_total)
        yield faults
        yield CounterMetricFamily(
            "torchyard_job_stalls",
            "Running jobs the watchdog flagged stalled (service.loops.watch), since the service started.",
            value=reconciler.watch.stalls_total,
        )

    @staticmethod
    def _disk(runtime: Runtime) -> Iterable[Metric]:
        with Session(runtime.engine) as session:
            folders = retention.folder_totals(session)
        yield GaugeMetricFamily(
            "torchyard_job_folders",
            "Job folders still on disk whose size was measured (when the job ended; hourly while it runs).",
            value=folders.count,
        )
        yield GaugeMetricFamily(
            "torchyard_job_folders_bytes", "Bytes those job folders take together.", value=folders.bytes
        )
        yield GaugeMetricFamily(
            "torchyard_job_folder_largest_bytes",
            "Bytes the largest of them takes (which: GET /api/v1/folders, admins; `torchyard folders`).",
            value=folders.largest,
        )
        try:
            usage = shutil.disk_usage(runtime.settings.data_dir)
        except OSError:  # the data directory is gone or unreadable: no numbers rather than wrong ones
            pass
        else:
            yield GaugeMetricFamily(
                "torchyard_data_dir_free_bytes", "Free space on the data directory's disk.", value=usage.free
            )
            yield GaugeMetricFamily(
                "torchyard_data_dir_size_bytes", "Size of the data directory's disk.", value=usage.total
            )
        housekeeper = runtime.housekeeper
        yield CounterMetricFamily(
            "torchyard_retention_freed_bytes",
            "Bytes this process's retention passes deleted from finished jobs' folders.",
            value=housekeeper.freed_bytes,
        )
        yield GaugeMetricFamily(
            "torchyard_retention_last_pass_timestamp_seconds",
            "When this process's last retention pass completed (0: none yet).",
            value=housekeeper.last_pass_at,
        )


HELD_S = "torchyard.held_s"  # scope key: seconds a long poll spent waiting, left out of its latency


class LatencyMiddleware:
    """Plain ASGI (no BaseHTTPMiddleware: it costs a task per request on the polling hot path)."""

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self._app = app
        self._histogram = metrics.request_seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self._app(scope, receive, send_and_note)
        finally:
            # The router writes the matched route into the shared scope: its template, not the path.
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            took = time.perf_counter() - started - scope.get(HELD_S, 0.0)
            self._histogram.labels(scope["method"], route, str(status)).observe(max(0.0, took))
