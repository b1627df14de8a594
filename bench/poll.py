"""Polling cost: what 50 dashboards cost the service, 304 path against 200 path (wrk, loopback, bounded).

With --jobs in the ledger (the newest --running of them running) and 50 concurrent pollers:
- GET /api/v1/jobs?limit=50: fresh (200, the page built) and revalidated (each poller sends back the
  ETag it got last, as the dashboard does: 304 while nothing changed, 200 when something did);
- GET /api/v1/jobs/{id} (a finished job): fresh and revalidated;
against a bare FastAPI hello-world measured in the same run.

--busy R: meanwhile a writer drives R operations a second (bench.writer: POSTs and progress updates of
the running jobs, each a ledger commit or more), and reports the rate it reached and its POST latency.
Targets at R = 20: list and job 200 paths >= 0.25x hello-world, 304 paths >= 0.5x, POST p99 < 200 ms.

Run: .venv/bin/python -m bench.poll [--seconds 10] [--jobs 10000] [--busy 20]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import WrkResult, header_script, server, torchyard, wrk
from bench.seed import seed_jobs, sqlite_url
from bench.writer import Writer, WriterResult

POLLERS = 50

# Each wrk thread keeps the last tag it was given and sends it back: a poller that revalidates.
REVALIDATE = """
local tag = nil
request = function()
  if tag then wrk.headers["If-None-Match"] = tag end
  return wrk.format()
end
response = function(status, headers, body)
  local got = headers["etag"] or headers["ETag"]
  if got then tag = got end
end
"""


def measure(url: str, seconds: int, auth: dict[str, str], quiet: bool) -> tuple[WrkResult, WrkResult]:
    """(200 path, 304 path) for one URL."""
    first = httpx.get(url, headers=auth)
    first.raise_for_status()
    check = httpx.get(url, headers={**auth, "If-None-Match": first.headers["ETag"]})
    assert check.status_code == 304 or not quiet, f"{url} did not revalidate: {check.status_code}"
    fresh = wrk(url, connections=POLLERS, seconds=seconds, script=header_script(auth))
    revalidated = wrk(url, connections=POLLERS, seconds=seconds, script=header_script(auth) + REVALIDATE)
    return fresh, revalidated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=20, help="the newest N jobs are running")
    parser.add_argument("--busy", type=float, default=0.0, help="writer operations a second (0: quiet)")
    parser.add_argument("--database-url", help="an empty PostgreSQL database (default: SQLite in a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "ledger"
        started = time.perf_counter()
        database_url = args.database_url or sqlite_url(data)
        seed_jobs(database_url, data, args.jobs, running=args.running)
        print(
            f"{args.jobs} jobs seeded in {time.perf_counter() - started:.1f} s; "
            f"{POLLERS} connections, {args.seconds} s per run; "
            + (f"writer at {args.busy:g} operations/s\n" if args.busy else "ledger quiet\n")
        )
        with server("bench.baselines:hello") as url:
            hello = wrk(url + "/", connections=POLLERS, seconds=args.seconds)
        running = list(range(args.jobs - args.running + 1, args.jobs + 1))
        env = {"TORCHYARD_DATA_DIR": str(data), "TORCHYARD_DATABASE_URL": database_url}
        with torchyard("bench.apps:torchyard_null", env) as (url, auth):
            with Writer(url, auth, database_url, args.busy, running) as writer:
                quiet = not args.busy
                list_200, list_304 = measure(url + "/api/v1/jobs?limit=50", args.seconds, auth, quiet)
                job_200, job_304 = measure(url + f"/api/v1/jobs/{args.jobs // 2}", args.seconds, auth, quiet)
            written = writer.result()
    report(hello, list_200, list_304, job_200, job_304, written if args.busy else None)


def report(
    hello: WrkResult,
    list_200: WrkResult,
    list_304: WrkResult,
    job_200: WrkResult,
    job_304: WrkResult,
    written: WriterResult | None,
) -> None:
    rows = [
        ("bare FastAPI hello-world", hello),
        ("GET /api/v1/jobs?limit=50      200", list_200),
        ("GET /api/v1/jobs?limit=50      revalidate", list_304),
        ("GET /api/v1/jobs/{id}          200", job_200),
        ("GET /api/v1/jobs/{id}          revalidate", job_304),
    ]
    for label, result in rows:
        print(result.line(label) + f"   {result.requests_per_s / hello.requests_per_s:5.2f}x hello")
    print(
        f"\nlist: revalidating {list_304.requests_per_s / list_200.requests_per_s:.1f}x the 200 path "
        f"(p99 {list_304.p99_ms:.1f} ms vs {list_200.p99_ms:.1f} ms)"
    )
    print(
        f"job:  revalidating {job_304.requests_per_s / job_200.requests_per_s:.1f}x the 200 path "
        f"(p99 {job_304.p99_ms:.1f} ms vs {job_200.p99_ms:.1f} ms)"
    )
    if written is not None:
        print(written.line())
        print(verdict(hello, list_200, list_304, job_200, job_304, written))


# Issue "Reads stay cheap while jobs run": at R = 20, the 200 paths >= 0.25x hello-world, the 304
# paths >= 0.5x, and the writer reaches its R with POST p99 < 200 ms.
FRESH_FLOOR, REVALIDATE_FLOOR, POST_P99_MS = 0.25, 0.5, 200.0


def verdict(
    hello: WrkResult,
    list_200: WrkResult,
    list_304: WrkResult,
    job_200: WrkResult,
    job_304: WrkResult,
    written: WriterResult,
) -> str:
    """The targets (set for R = 20), each with what this run measured."""

    def floor(result: WrkResult, ratio: float) -> bool:
        return result.requests_per_s / hello.requests_per_s >= ratio

    checks = [
        (f"list 200 >= {FRESH_FLOOR}x", floor(list_200, FRESH_FLOOR)),
        (f"job 200 >= {FRESH_FLOOR}x", floor(job_200, FRESH_FLOOR)),
        (f"list 304 >= {REVALIDATE_FLOOR}x", floor(list_304, REVALIDATE_FLOOR)),
        (f"job 304 >= {REVALIDATE_FLOOR}x", floor(job_304, REVALIDATE_FLOOR)),
        ("writer at its rate", written.operations_per_s >= 0.95 * written.target_per_s),
        (f"POST p99 < {POST_P99_MS:.0f} ms", written.post_p99_ms < POST_P99_MS),
    ]
    missed = [label for label, held in checks if not held]
    return "targets (set for R = 20): " + ("all hold" if not missed else "MISSED " + ", ".join(missed))


if __name__ == "__main__":
    main()
