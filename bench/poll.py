"""Polling cost: what 50 dashboards cost the service, 304 path against 200 path (wrk, loopback, bounded).

With 10,000 jobs in the ledger and 50 concurrent pollers:
- GET /api/v1/jobs?limit=50: fresh (200, the page built) and revalidated (If-None-Match -> 304);
- GET /api/v1/jobs/{id}: fresh and revalidated;
against a bare FastAPI hello-world measured in the same run.

Run: .venv/bin/python -m bench.poll [--seconds 10] [--jobs 10000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from bench.api import seed_jobs
from bench.harness import WrkResult, header_script, server, torchyard, wrk

POLLERS = 50


def if_none_match_script(tag: str) -> str:
    # The tag carries double quotes; a Lua long string takes it verbatim.
    return f'wrk.headers["If-None-Match"] = [[{tag}]]\n'


def measure(url: str, seconds: int, auth: dict[str, str]) -> tuple[WrkResult, WrkResult]:
    """(200 path, 304 path) for one URL."""
    first = httpx.get(url, headers=auth)
    first.raise_for_status()
    tag = first.headers["ETag"]
    check = httpx.get(url, headers={**auth, "If-None-Match": tag})
    assert check.status_code == 304, f"{url} did not revalidate: {check.status_code}"
    fresh = wrk(url, connections=POLLERS, seconds=seconds, script=header_script(auth))
    revalidated = wrk(
        url, connections=POLLERS, seconds=seconds, script=header_script(auth) + if_none_match_script(tag)
    )
    return fresh, revalidated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "ledger"
        started = time.perf_counter()
        seed_jobs(data / "torchyard.db", data, args.jobs)
        print(
            f"{args.jobs} jobs seeded in {time.perf_counter() - started:.1f} s; "
            f"{POLLERS} connections, {args.seconds} s per run\n"
        )
        with server("bench.baselines:hello") as url:
            hello = wrk(url + "/", connections=POLLERS, seconds=args.seconds)
        with torchyard("bench.apps:torchyard_null", {"TORCHYARD_DATA_DIR": str(data)}) as (url, auth):
            list_200, list_304 = measure(url + "/api/v1/jobs?limit=50", args.seconds, auth)
            job_200, job_304 = measure(url + f"/api/v1/jobs/{args.jobs // 2}", args.seconds, auth)
    rows = [
        ("bare FastAPI hello-world", hello),
        ("GET /api/v1/jobs?limit=50      200", list_200),
        ("GET /api/v1/jobs?limit=50      304", list_304),
        ("GET /api/v1/jobs/{id}          200", job_200),
        ("GET /api/v1/jobs/{id}          304", job_304),
    ]
    for label, result in rows:
        print(result.line(label) + f"   {result.requests_per_s / hello.requests_per_s:5.2f}x hello")
    print(
        f"\nlist: 304 path {list_304.requests_per_s / list_200.requests_per_s:.1f}x the 200 path "
        f"(p99 {list_304.p99_ms:.1f} ms vs {list_200.p99_ms:.1f} ms)"
    )
    print(
        f"job:  304 path {job_304.requests_per_s / job_200.requests_per_s:.1f}x the 200 path "
        f"(p99 {job_304.p99_ms:.1f} ms vs {job_200.p99_ms:.1f} ms)"
    )


if __name__ == "__main__":
    main()
