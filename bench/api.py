"""API throughput against bare baselines measured in the same run (wrk, loopback, bounded).

1. POST /api/v1/jobs, 32 connections, vs a bare FastAPI + SQLite insert endpoint.
   Target: at least 1.5x the bare endpoint, p99 under 200 ms; and not below 2.17x, the figure issue
   "Reads stay cheap while jobs run" measured before its changes.
2. GET /api/v1/jobs (50 newest) with 100,000 jobs in the ledger, vs a bare hello-world.
   Target: at least 0.25x hello-world; and not below that issue's 0.66x.

Run: .venv/bin/python -m bench.api [--seconds 10]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from bench.harness import header_script, post_script, server, torchyard, wrk
from bench.seed import seed_jobs, sqlite_url

JOB_BODY = json.dumps(
    {"name": "bench", "entrypoint": "worker.tasks.seed:ddp_parameters", "resources": {"tasks_per_node": 3}}
)

# The quiet figures issue "Reads stay cheap while jobs run" measured before its changes: no change
# may take them below these.
POST_FLOOR, LIST_FLOOR = 2.17, 0.66


def held(ratio: float, floor: float) -> str:
    return "holds" if ratio >= floor else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmpdir = Path(tmp)
        print(f"POST, 32 connections, {args.seconds} s each")
        with server("bench.baselines:insert", {"BENCH_DB": str(tmpdir / "bare.db")}) as url:
            bare = wrk(
                url + "/rows",
                connections=32,
                seconds=args.seconds,
                script=post_script(json.dumps({"name": "bench", "payload": JOB_BODY})),
            )
        env = {"TORCHYARD_DATA_DIR": str(tmpdir / "post")}
        with torchyard("bench.apps:torchyard_null", env) as (url, auth):
            ours = wrk(
                url + "/api/v1/jobs",
                connections=32,
                seconds=args.seconds,
                script=post_script(JOB_BODY, auth),
            )
        print(bare.line("bare FastAPI + SQLite insert"))
        print(ours.line("torchyard POST /api/v1/jobs"))
        ratio = ours.requests_per_s / bare.requests_per_s
        verdict = held(ratio, POST_FLOOR)
        print(f"ratio {ratio:.2f}x (target >= 1.5x, p99 < 200 ms; not below {POST_FLOOR}x: {verdict})\n")

        started = time.perf_counter()
        seed_jobs(sqlite_url(tmpdir / "list"), tmpdir / "list", args.jobs)
        seeded_s = time.perf_counter() - started
        print(f"GET 50 newest of {args.jobs} jobs (seeded in {seeded_s:.1f} s), 32 connections")
        with server("bench.baselines:hello") as url:
            hello = wrk(url + "/", connections=32, seconds=args.seconds)
        with torchyard("bench.apps:torchyard_null", {"TORCHYARD_DATA_DIR": str(tmpdir / "list")}) as (
            url,
            auth,
        ):
            listing = wrk(
                url + "/api/v1/jobs?limit=50",
                connections=32,
                seconds=args.seconds,
                script=header_script(auth),
            )
        print(hello.line("bare FastAPI hello-world"))
        print(listing.line("torchyard GET /api/v1/jobs?limit=50"))
        ratio = listing.requests_per_s / hello.requests_per_s
        print(f"ratio {ratio:.2f}x (target >= 0.25x; not below {LIST_FLOOR}x: {held(ratio, LIST_FLOOR)})")


if __name__ == "__main__":
    main()
