"""What one user's queue costs another user's job at dispatch: mallory has queued `--flood` jobs, then
alice submits one. Measured as alice meets it: the time from the dispatcher's first tick until her
job is handed to the backend, where each hand-over costs `--hand-over-ms` (a fork, an sbatch). Three
runs on the same ledger shape: alice alone (the quiet baseline), behind the flood with the claim in id
order (what the dispatcher did before fair_claims), and behind it with owners in turn (what it does).
Then what the owners-in-turn claim query costs against the id-order one, with the flood queued.

Run: .venv/bin/python -m bench.fair_claims [--flood 1000] [--hand-over-ms 5] [--database-url postgresql://...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import ColumnElement, String, Subquery, cast, insert, literal, update
from sqlalchemy import select as core_select
from sqlmodel import col

from bench.scale import empty_ledger
from bench.seed import sqlite_url
from service.backends.base import SubmitOutcome
from service.config import Settings
from service.ledger.db import make_engine, migrate
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.loops import fair_claims
from service.loops.dispatch import Dispatcher
from worker.spec import RunSpec

SPEC = {"entrypoint": "worker.tasks.faults:sleep", "resources": {}}


class TimedBackend:
    """Hands jobs over one at a time, each costing `cost_s`; notes when alice's job went."""

    name = "local"
    runs_arrays = False
    max_nodes = 1

    def __init__(self, cost_s: float, watched: int) -> None:
        self.cost_s, self.watched = cost_s, watched
        self.handed_at: float | None = None

    def submit(self, specs: Sequence[RunSpec]) -> list[SubmitOutcome]:
        outcomes = []
        for spec in specs:
            time.sleep(self.cost_s)
            if spec.job_id == self.watched:
                self.handed_at = time.perf_counter()
            outcomes.append(SubmitOutcome(spec.job_id, external_id=f"local-{spec.job_id}"))
        return outcomes


def by_id(candidates: ColumnElement[bool]) -> Subquery:
    """The claim before fair_claims: the oldest queued jobs, whoever owns them (each its own turn)."""
    return core_select(col(Job.id), col(Job.id).label("turn")).where(candidates).subquery("turns")


def queue(url: str, data: Path, flood: int) -> int:
    """`flood` of mallory's jobs queued, then alice's one; returns alice's job id."""
    engine = make_engine(url)
    migrate(engine)
    now = utcnow()
    rows = [_row("mallory", n, now) for n in range(flood)] + [_row("alice", 0, now)]
    with engine.begin() as connection:
        connection.execute(insert(Job), rows)
        last = connection.execute(core_select(col(Job.id)).order_by(col(Job.id).desc()).limit(1)).scalar_one()
        folders = literal(f"{data / 'jobs'}/") + cast(col(Job.id), String)
        connection.execute(update(Job).values(folder=folders))
    engine.dispose()
    assert last is not None
    return last


def _row(owner: str, n: int, now: object) -> dict[str, object]:
    return {"name": f"{owner}{n}", "owner": owner, "backend": "local", "spec": SPEC, "state": "queued",
            "attempt": 1, "created_at": now, "updated_at": now}  # fmt: skip


def alice_waits(url: str | None, flood: int, cost_s: float, fair: bool) -> float:
    """Seconds from the first tick until alice's job is handed over."""
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder)
        ledger = url or sqlite_url(data)
        empty_ledger(ledger)
        alice = queue(ledger, data, flood)
        settings = Settings(database_url=ledger, data_dir=data, default_backend="local")
        engine = make_engine(ledger)
        backend = TimedBackend(cost_s, alice)
        dispatcher = Dispatcher(engine, {"local": backend}, settings)  # type: ignore[dict-item]
        kept = fair_claims.turns
        fair_claims.turns = kept if fair else by_id
        try:
            started = time.perf_counter()
            while backend.handed_at is None:
                dispatcher.dispatch_once()
            return backend.handed_at - started
        finally:
            fair_claims.turns = kept
            engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=1000)
    parser.add_argument("--hand-over-ms", type=float, default=5.0)
    parser.add_argument("--database-url")
    args = parser.parse_args()
    cost_s = args.hand_over_ms / 1000
    quiet = alice_waits(args.database_url, 0, cost_s, fair=True)
    in_id_order = alice_waits(args.database_url, args.flood, cost_s, fair=False)
    in_turn = alice_waits(args.database_url, args.flood, cost_s, fair=True)
    print(
        f"alice's job handed over, {args.flood} of mallory's queued before it, {args.hand_over_ms:g} ms each:"
    )
    print(f"  alone (baseline)        {quiet * 1000:9.1f} ms")
    print(f"  claims in id order      {in_id_order * 1000:9.1f} ms  ({in_id_order / quiet:.1f}x)")
    print(f"  claims owners in turn   {in_turn * 1000:9.1f} ms  ({in_turn / quiet:.1f}x)")


if __name__ == "__main__":
    main()
