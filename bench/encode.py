"""What rendering one job's public JSON costs, step by step, and what orjson or msgspec would change.

A poll renders a job only when the job changed since it was last rendered (service.api.fragments);
a rendering is JobPublic.model_validate(row) and pydantic-core's model_dump_json. orjson and msgspec
encode plain objects, not a pydantic model: to use one the model is dumped to a dict first (or the
row turned into JobPublic's JSON shape by hand, a second definition of that shape). This prints
each step's cost per job on 1,000 seeded jobs, and the ratio of each whole rendering against
today's, measured in the same run (best of 5).

Run: .venv/bin/python -m bench.encode   (orjson and msgspec are compared when installed:
     .venv/bin/pip install orjson msgspec)
"""

from __future__ import annotations

import importlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.seed import seed_jobs, sqlite_url
from service.api.driver_read import DriverRead
from service.domain import jobs
from service.ledger.db import make_engine
from service.ledger.models.jobs import JobPublic

JOBS = 1000


def rows_of_seeded_jobs(folder: Path) -> list[jobs.JobRow]:
    url = sqlite_url(folder)
    seed_jobs(url, folder, JOBS, running=JOBS // 50)
    engine = make_engine(url)
    found: list[jobs.JobRow] = []
    with engine.connect() as connection:
        for statement, values in jobs.job_reads(range(1, JOBS + 1)):
            found += jobs.jobs_found(DriverRead(statement, engine.dialect).all(connection, values))
    engine.dispose()
    return found


def per_job_us(step: Callable[[], object], count: int) -> float:
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - started)
    return best / count * 1e6


def optional(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


VALIDATE = "model_validate (row -> JobPublic)"
DUMP_JSON = "model_dump_json (pydantic-core)"
DUMP = "model_dump (JobPublic -> dict)"
ENCODERS = {"orjson": "orjson.dumps (dict -> JSON)", "msgspec": "msgspec encode (dict -> JSON)"}


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="torchyard-bench-") as name:
        rows = rows_of_seeded_jobs(Path(name))
    models = [JobPublic.model_validate(row) for row in rows]
    dumped = [model.model_dump() for model in models]
    steps: dict[str, Callable[[], object]] = {
        VALIDATE: lambda: [JobPublic.model_validate(row) for row in rows],
        DUMP_JSON: lambda: [model.model_dump_json() for model in models],
        DUMP: lambda: [model.model_dump() for model in models],
    }
    orjson, msgspec = optional("orjson"), optional("msgspec")
    if orjson is not None:
        steps[ENCODERS["orjson"]] = lambda: [orjson.dumps(one) for one in dumped]
    if msgspec is not None:
        encoder = msgspec.json.Encoder()
        steps[ENCODERS["msgspec"]] = lambda: [encoder.encode(one) for one in dumped]
    cost = {label: per_job_us(step, len(rows)) for label, step in steps.items()}
    print(f"per job, {len(rows)} seeded jobs, best of 5:")
    for label, us in cost.items():
        print(f"  {label:36s} {us:6.1f} µs")

    today = cost[VALIDATE] + cost[DUMP_JSON]
    print(f"\nwhole rendering, today (validate + model_dump_json): {today:.1f} µs = 1.00x")
    for library, label in ENCODERS.items():
        if label not in cost:
            print(f"  {library}: not installed, not compared")
            continue
        whole = cost[VALIDATE] + cost[DUMP] + cost[label]
        print(f"  validate + model_dump + {library}: {whole:.1f} µs = {whole / today:.2f}x")
        alone = cost[label] / cost[DUMP_JSON]
        print(f"    ({library} alone, were the row in JSON shape for free: {alone:.2f}x)")


if __name__ == "__main__":
    main()
