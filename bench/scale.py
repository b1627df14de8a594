"""How the reads grow with the ledger: 10^4, 10^5 and 10^6 jobs (wrk, 32 connections, loopback).

At each size (bench.seed: half the jobs `train-resnet-<id>`, half `eval-bert-<id>`, the newest 1%
running), uncached:
- GET /api/v1/jobs?limit=50: the 50 newest;
- ?name=<7 digits>: a substring one job holds (rare); ?name=<part of "train-resnet", its case mixed>:
  a substring half the jobs hold (common);
- ?state=running (1% of the jobs) and ?state=succeeded (the rest);
- GET /api/v1/jobs/{id}, a random job;
against a bare FastAPI hello-world measured in the same run. No page cache answers: every list request
carries a cursor of its own beyond the newest job (the page is still the newest 50), and the name
requests a name of their own too. Target: filtered by name or state, 10^6 jobs, p99 < 50 ms.

Run: .venv/bin/python -m bench.scale [--sizes 10000,100000,1000000] [--seconds 5]
     [--database-url postgresql+psycopg2://...]  (a database of its own: its jobs are emptied)
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import text

from bench.harness import WrkResult, header_script, server, torchyard, wrk
from bench.seed import NAMES, seed_jobs, sqlite_url
from service.domain.cursors import encode_cursor
from service.ledger.db import is_sqlite, make_engine, migrate

CONNECTIONS = 32
PATHS = 60_000  # distinct requests per measurement: more than wrk sends in its seconds
TARGET_P99_MS = 50.0

THREADS = 2
# Each wrk thread walks its own share of `paths` (every THREADS-th), so no two requests are alike.
WALK = f"""
local threads, counter = 0, 0
function setup(thread)
  thread:set("id", threads)
  threads = threads + 1
end
request = function()
  counter = counter + 1
  return wrk.format(nil, paths[((counter * {THREADS} + id) % #paths) + 1])
end
"""


def lua_paths(paths: list[str]) -> str:
    return "paths = {" + ",".join(f'"{p}"' for p in paths) + "}\n"


def walk_script(paths: list[str], auth: dict[str, str]) -> str:
    return header_script(auth) + lua_paths(paths) + WALK


def mixed_case(text: str, rng: random.Random) -> str:
    return "".join(c.upper() if rng.random() < 0.5 else c for c in text)


def requests(size: int, rng: random.Random) -> dict[str, Callable[[int], str]]:
    """label -> the n-th request's path."""
    common = NAMES[0]

    def cursor(n: int) -> str:
        return encode_cursor(size + 1 + n)  # beyond the newest job: the newest page, a query of its own

    def common_name(_n: int) -> str:
        start = rng.randrange(len(common) - 4)
        return mixed_case(common[start : start + rng.randint(4, len(common) - start)], rng)

    return {
        "newest 50": lambda n: f"/api/v1/jobs?limit=50&cursor={cursor(n)}",
        "name, rare (1 job)": lambda n: (
            f"/api/v1/jobs?limit=50&name={rng.randint(1, size):07d}&cursor={cursor(n)}"
        ),
        "name, common (1/2)": lambda n: f"/api/v1/jobs?limit=50&name={common_name(n)}&cursor={cursor(n)}",
        "state=running (1%)": lambda n: f"/api/v1/jobs?limit=50&state=running&cursor={cursor(n)}",
        "state=succeeded (99%)": lambda n: f"/api/v1/jobs?limit=50&state=succeeded&cursor={cursor(n)}",
        "one job GET": lambda n: f"/api/v1/jobs/{rng.randint(1, size)}",
    }


def empty_ledger(database_url: str) -> None:
    """A PostgreSQL ledger without jobs (SQLite: a new file each size)."""
    if is_sqlite(database_url):
        return
    engine = make_engine(database_url)
    migrate(engine)
    with engine.begin() as connection:
        connection.execute(text("TRUNCATE job RESTART IDENTITY CASCADE"))
    engine.dispose()


def measure_size(size: int, database_url: str | None, seconds: int, data: Path) -> dict[str, WrkResult]:
    url = database_url or sqlite_url(data)
    empty_ledger(url)
    started = time.perf_counter()
    seed_jobs(url, data, size, running=max(1, size // 100))
    print(f"\n{size:,} jobs seeded in {time.perf_counter() - started:.0f} s", flush=True)
    rng = random.Random(size)
    results: dict[str, WrkResult] = {}
    env = {"TORCHYARD_DATA_DIR": str(data), "TORCHYARD_DATABASE_URL": url}
    with torchyard("bench.apps:torchyard_null", env) as (base, auth):
        for label, path in requests(size, rng).items():
            script = walk_script([path(n) for n in range(PATHS)], auth)
            result = wrk(base + "/", connections=CONNECTIONS, seconds=seconds, script=script, threads=THREADS)
            results[label] = result
            print(result.line(f"  {label}"), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--database-url", help="PostgreSQL database to fill (default: SQLite in a temp dir)")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    with server("bench.baselines:hello") as url:
        hello = wrk(url + "/", connections=CONNECTIONS, seconds=args.seconds)
    print(hello.line("bare FastAPI hello-world"))
    table: dict[int, dict[str, WrkResult]] = {}
    for size in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            table[size] = measure_size(size, args.database_url, args.seconds, Path(tmp))
    report(hello, table, "PostgreSQL" if args.database_url else "SQLite")


def report(hello: WrkResult, table: dict[int, dict[str, WrkResult]], database: str) -> None:
    print(
        f"\n{database}, wrk {CONNECTIONS} connections, uncached; "
        f"hello-world {hello.requests_per_s:,.0f} req/s\n"
    )
    print("| request | " + " | ".join(f"{size:,} jobs: req/s, p99" for size in table) + " |")
    print("|---|" + "---|" * len(table))
    for label in next(iter(table.values())):
        cells = [
            f"{r.requests_per_s:,.0f} ({r.requests_per_s / hello.requests_per_s:.2f}x), {r.p99_ms:.1f} ms"
            + ("" if r.non_2xx == 0 else f", {r.non_2xx} errors")
            for r in (results[label] for results in table.values())
        ]
        print(f"| {label} | " + " | ".join(cells) + " |")
    largest = table[max(table)]
    filtered = {label: r for label, r in largest.items() if label.startswith(("name", "state"))}
    worst = max(filtered.values(), key=lambda r: r.p99_ms)
    verdict = "holds" if worst.p99_ms < TARGET_P99_MS else "MISSED"
    print(
        f"\ntarget p99 < {TARGET_P99_MS:.0f} ms for name/state at {max(table):,} jobs: {verdict} "
        f"(worst {worst.p99_ms:.1f} ms)"
    )


if __name__ == "__main__":
    main()
