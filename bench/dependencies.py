"""What jobs waiting for others cost the dispatch loop: every tick begins by settling them
(service.domain.dependencies.settle_waiting). Measured as users meet it: a ledger of many jobs, some
running, and thousands of jobs waiting on those running ones (a night's worth of pipelines queued
behind a few long trainings), against the same ledger with none waiting. Then the cost of moving a
batch of them once their dependencies end. Wall ms per tick, best of 5.

Run: .venv/bin/python -m bench.dependencies [--jobs 100000] [--waiting 10000] [--database-url postgresql://...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.engine import Engine
from sqlmodel import col

from bench.scale import empty_ledger
from bench.seed import seed_jobs, sqlite_url
from service.bulkhead import Bulkhead
from service.domain.dependencies import settle_due
from service.ledger.db import make_engine
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.pipelines import JobDependency
from service.states import JobState

ROUNDS = 5


def best_ms(work: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(ROUNDS):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def tick(engine: Engine) -> int:
    """What the dispatcher's tick does first."""
    return settle_due(engine, Bulkhead("bench"))


def job_row(name: str, state: JobState) -> dict[str, Any]:
    now = utcnow()
    return {"name": name, "owner": "bench", "backend": "local", "spec": {}, "state": state.value,
            "created_at": now, "updated_at": now}  # fmt: skip


def add_waiting(engine: Engine, upstream: list[int], count: int) -> list[int]:
    """`count` jobs waiting on the `upstream` jobs (round robin), as the intake stores them."""
    rows = [job_row(f"eval-{i}", JobState.waiting) for i in range(count)]
    with engine.begin() as connection:
        ids = [int(i) for i in connection.execute(insert(Job).returning(col(Job.id)), rows).scalars()]
        connection.execute(
            insert(JobDependency),
            [{"job_id": job_id, "upstream_id": upstream[i % len(upstream)], "on": "succeeded", "position": 0}
             for i, job_id in enumerate(ids)],
        )  # fmt: skip
    return ids


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--running", type=int, default=20)
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--moving", type=int, default=500)
    parser.add_argument("--database-url", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        url = args.database_url or sqlite_url(Path(folder))
        empty_ledger(url)
        seed_jobs(url, Path(folder), args.jobs, running=args.running)
        engine = make_engine(url)
        running = list(range(args.jobs - args.running + 1, args.jobs + 1))
        baseline = best_ms(lambda: tick(engine))
        add_waiting(engine, running, args.waiting)
        stuck = best_ms(lambda: tick(engine))
        # A batch whose dependency just ended: the tick that queues them (made anew each round).
        moving_ms = float("inf")
        for _ in range(ROUNDS):
            with engine.begin() as connection:
                row = job_row("train", JobState.running)
                upstream = int(connection.execute(insert(Job).returning(col(Job.id)), [row]).scalar_one())
            add_waiting(engine, [upstream], args.moving)
            with engine.begin() as connection:
                connection.execute(
                    update(Job).where(col(Job.id) == upstream).values(state=JobState.succeeded.value)
                )
            started = time.perf_counter()
            moved = tick(engine)
            moving_ms = min(moving_ms, (time.perf_counter() - started) * 1000)
            assert moved == args.moving, moved
        engine.dispose()
    print(f"ledger: {args.jobs} jobs ({args.running} running), {url.split(':')[0]}")
    print(f"settling tick, none waiting (baseline):        {baseline:8.2f} ms")
    print(
        f"settling tick, {args.waiting} waiting on running jobs: {stuck:8.2f} ms  ({stuck / baseline:.2f}x)"
    )
    print(f"tick that queues {args.moving} whose dependency ended: {moving_ms:8.2f} ms  "
          f"({moving_ms / args.moving * 1000:.0f} µs a job)")  # fmt: skip


if __name__ == "__main__":
    main()
