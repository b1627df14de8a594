"""The noisy-neighbour test's parts (issue 43): a real `torchyard serve` (local backend, webhooks to
127.0.0.1), alice who measures what she waits for, and mallory who does everything issue 43 found
one user could do to hold what the service shares, all at once (tests/integration/mallory.py).

alice's round (`measure`): small real jobs one after another, each submitted (POST /api/v1/jobs
timed), its time in `queued` read back (submitted_at - created_at), and the time from its ending
(finished_at) to its webhook reaching a fast receiver; while each job is under way, her reads are
timed over and over: /healthz, GET /api/v1/jobs, GET /api/v1/notifications/subscriptions.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from service.ledger.db import make_engine, migrate
from service.states import TERMINAL_STATE_NAMES
from tests.cli_service import serving, torchyard_command
from tests.integration.slurm.conftest import Api, service_env
from tests.serving import free_port
from tests.support import ROOT, issue_token
from tests.webhook_receiver import Received, Receiver

JOBS = "/api/v1/jobs"
SUBSCRIPTIONS = "/api/v1/notifications/subscriptions"
READS = {"healthz": "/healthz", "list jobs": JOBS, "list subscriptions": SUBSCRIPTIONS}
QUICK = {"entrypoint": "worker.tasks.faults:sleep", "kwargs": {"seconds": 0.1}, "retries": {"max": 0}}
# Where the service's defaults are larger than the test needs: mallory reaches her cap within seconds.
# Her other caps are the defaults (captures 2 and waiters 16 per user, uploads 2 in flight per user).
CAPS = {"max_subscriptions_per_user": "20"}
SETTINGS = {
    "backends": "local",
    "webhook_hosts": "127.0.0.1",
    "webhook_private_hosts": "127.0.0.1",
    "webhook_ports": "1024-65535",  # the receivers' free ports
    "notify_interval_s": "0.2",
    "webhook_backoff_s": "0.3",
    "local_reconcile_interval_s": "0.1",
    "dispatch_interval_s": "0.1",
    "allowed_script_dirs": str(ROOT / "tests" / "data"),
    "max_code_bytes": str(16 << 20),  # an archive may unpack to 4 times this: 64 MiB
    "max_code_bytes_per_user": str(1 << 30),  # mallory's uploads meet the caps, not her byte quota
    **CAPS,
}


@dataclass(frozen=True)
class Neighbours:
    url: str
    alice: Api
    mallory: Api  # her token may upload code


@contextmanager
def neighbourhood(tmp: Path, database_url: str) -> Iterator[Neighbours]:
    """`torchyard serve` on `database_url` with a token for alice and one for mallory, until the block
    ends (then SIGINT: the service stops its loops, and cancels nothing: the caller ends the jobs)."""
    url = f"http://127.0.0.1:{free_port()}"
    env = {**service_env(tmp / "data", database_url, **SETTINGS), "TORCHYARD_URL": url}
    engine = make_engine(database_url)
    try:
        migrate(engine)
        alice = issue_token(engine, "alice")
        mallory = issue_token(engine, "mallory", allow_code=True)
    finally:
        engine.dispose()
    port = url.rsplit(":", 1)[1]
    with serving([*torchyard_command(), "serve", "--port", port], env, tmp / "serve.log"):
        yield Neighbours(url, Api(url, alice), Api(url, mallory))


@dataclass
class Latencies:
    """Seconds alice waited, by what for."""

    seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def add(self, what: str, took: float) -> None:
        self.seconds[what].append(took)

    def p50(self, what: str) -> float:
        return statistics.median(self.seconds[what])

    def p90(self, what: str) -> float:
        values = sorted(self.seconds[what])
        return values[min(len(values) - 1, int(0.9 * len(values)))]

    def worst(self, what: str) -> float:
        return max(self.seconds[what])

    def summary(self) -> str:
        return ", ".join(
            f"{what} p50 {self.p50(what):.2f} p90 {self.p90(what):.2f} max {self.worst(what):.2f} s"
            f" (n={len(values)})"
            for what, values in sorted(self.seconds.items())
        )


def timed(call: Callable[[], httpx.Response]) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    response = call()
    return time.monotonic() - started, response


def read_once(alice: Api, latencies: Latencies) -> None:
    for what, path in READS.items():
        took, response = timed(lambda: alice.get(path))  # noqa: B023 (called at once)
        assert response.status_code == 200, (what, response.status_code, response.text[:300])
        latencies.add(what, took)


def subscribe(api: Api, url: str, on: list[str]) -> httpx.Response:
    return api.post(SUBSCRIPTIONS, {"url": url, "on": on})


def measure(alice: Api, receiver: Receiver, jobs: int, deadline_s: float) -> Latencies:
    """alice's round: up to `jobs` small jobs one after another (each run and notified), her reads
    timed all the while. Past `deadline_s` no job more is submitted, and a webhook not yet come
    counts as late as it is then; a job of hers not ended by then fails the test."""
    latencies = Latencies()
    deadline = time.monotonic() + deadline_s
    for n in range(jobs):
        if time.monotonic() > deadline:
            break
        body = {"name": f"alice-{n}", **QUICK}
        took, response = timed(lambda: alice.post(JOBS, body))  # noqa: B023 (called at once)
        assert response.status_code == 201, response.text
        latencies.add("submit", took)
        job, arrived = _follow(alice, receiver, int(response.json()["id"]), deadline, latencies)
        assert job["state"] == "succeeded", (job["state"], job["reason"])
        latencies.add("queued", moment(job["submitted_at"]) - moment(job["created_at"]))
        came = arrived.arrived_at if arrived else time.time()  # not come: as late as it is now
        latencies.add("webhook", came - moment(job["finished_at"]))
    return latencies


def _follow(
    alice: Api, receiver: Receiver, job_id: int, deadline: float, latencies: Latencies
) -> tuple[dict[str, Any], Received | None]:
    """Time alice's reads until her job has ended and its webhook came (or `deadline` passed)."""
    while True:
        job = alice.job(job_id)
        ended = job["state"] in TERMINAL_STATE_NAMES
        arrived = webhook(receiver, job_id)
        if ended and (arrived or time.monotonic() > deadline):
            return job, arrived
        assert time.monotonic() < deadline + 30, f"alice's job {job_id} is still {job['state']}"
        read_once(alice, latencies)
        time.sleep(0.1)


def webhook(receiver: Receiver, job_id: int) -> Received | None:
    return next((one for one in receiver.all() if one.json["job"]["id"] == job_id), None)


def moment(stamp: str) -> float:
    """An API timestamp as time.time() counts (UTC where it names no zone)."""
    parsed = datetime.fromisoformat(stamp)
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)).timestamp()


def end_jobs(api: Api, job_ids: list[int], timeout: float = 90) -> None:
    """Cancel every one of `job_ids` not ended yet, and wait until all have ended."""
    for job_id in job_ids:
        if api.job(job_id)["state"] not in TERMINAL_STATE_NAMES:
            api.post(f"{JOBS}/{job_id}/cancel")
    for job_id in job_ids:
        api.finished(job_id, timeout)


def check_within(quiet: Latencies, noisy: Latencies) -> list[str]:
    """Where alice's noisy latencies broke their bounds (see the test's docstring); none: []."""
    broken: list[str] = []
    for what, slack in [*((read, 0.5) for read in READS), ("submit", 1.0)]:
        bound = 3 * quiet.p50(what) + slack
        if noisy.p50(what) > bound:
            broken.append(f"{what}: p50 {noisy.p50(what):.2f} s > {bound:.2f} s")
    for what in READS:
        bound = 3 * quiet.p90(what) + 1.5
        if noisy.p90(what) > bound:
            broken.append(f"{what}: p90 {noisy.p90(what):.2f} s > {bound:.2f} s")
    late = quiet.worst("webhook") + 3
    if noisy.worst("webhook") > late:
        broken.append(f"webhook: {noisy.worst('webhook'):.2f} s after the ending > {late:.2f} s")
    queued = 3 * quiet.worst("queued") + 2
    if noisy.worst("queued") > queued:
        broken.append(f"queued: {noisy.worst('queued'):.2f} s > {queued:.2f} s")
    return broken


def statuses(answers: list[Any]) -> dict[int, int]:
    counted: dict[int, int] = defaultdict(int)
    for answer in answers:
        counted[answer.status] += 1
    return dict(counted)
