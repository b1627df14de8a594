"""torchyard on the real SLURM cluster of deploy/slurm against plain sbatch and raw submitit, same run.

(a) dispatch rate: 300 trivial jobs POSTed (32 connections) until all are accepted by SLURM (ledger
    state submitted or beyond), against a loop of 300 `sbatch --wrap true`. A blocker job holds the
    whole cluster meanwhile, so that nothing runs on either side; everything is scancelled after.
    Target: torchyard >= 3x the sbatch loop.
(b) a tiny 3-rank DDP job (the seed's ddp_parameters): POST -> succeeded, against raw submitit
    submit -> result() of the same RankLauncher. Target: <= 1.0x (rank 0's result is looked for
    between ticks, with no scheduler call).
(c) scheduler calls per reconcile interval with 1000 active jobs (a held job array entered in the
    ledger), the reconciler running in this process. Target: 1.

Loopback only. Run: .venv/bin/python -m bench.slurm [--rounds 3] [--parts abc]
"""

from __future__ import annotations

import argparse
import shlex
import sqlite3
import statistics
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import submitit

from bench.harness import post_many, time_job, torchyard
from service.backends.slurm import SlurmBackend
from service.config import Settings
from service.ledger.db import session_scope
from service.ledger.models.jobs import Job
from service.runtime import Runtime
from service.states import JobState
from worker.launch import RankLauncher
from worker.spec import Resources, RunSpec

TRIVIAL: dict[str, object] = {
    "name": "bench-trivial",
    "entrypoint": "worker.tasks.faults:sleep",
    "kwargs": {"seconds": 0},
    "resources": {"timeout_min": 1},
}
# Raw submitit inherits this process's environment (sbatch's default --export=ALL); the checkout
# on PYTHONPATH lets its ranks import the worker as torchyard's ranks import the staged copy.
RAW_SETUP = [f"export PYTHONPATH={shlex.quote(str(Path(__file__).resolve().parent.parent))}"]
DDP: dict[str, object] = {
    "name": "bench-ddp",
    "entrypoint": "worker.tasks.seed:ddp_parameters",
    "resources": {"tasks_per_node": 3, "timeout_min": 5},
}


def sh(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout


def squeue_ids(name: str) -> list[str]:
    return sh("squeue", "-h", "-r", "-n", name, "-o", "%i").split()


@contextmanager
def blocker() -> Iterator[None]:
    """A job holding all 8 CPUs: whatever is submitted meanwhile pends, nothing runs."""
    job = sh("sbatch", "--parsable", "-J", "bench-blocker", "-N", "2", "--ntasks-per-node", "4",
             "-o", "/dev/null", "--wrap", "sleep 600").strip()
    try:
        # It waits for whatever still runs (a job of the previous round that was starting up).
        deadline = time.monotonic() + 120
        while sh("squeue", "-h", "-j", job, "-o", "%T").strip() != "RUNNING":
            if time.monotonic() > deadline:
                raise SystemExit("the blocker job did not start")
            time.sleep(0.2)
        yield
    finally:  # never left behind holding the cluster, whatever happened
        subprocess.run(["scancel", job], check=False)


def sbatch_loop(count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        sh("sbatch", "--parsable", "-J", "bench-loop", "-o", "/dev/null", "--wrap", "true")
    elapsed = time.perf_counter() - started
    subprocess.run(["scancel", "-n", "bench-loop"], check=False)
    return elapsed


def torchyard_dispatch(url: str, auth: dict[str, str], ledger: Path, count: int) -> float:
    with sqlite3.connect(ledger) as db:
        already = db.execute("SELECT count(*) FROM job WHERE name = ?", (TRIVIAL["name"],)).fetchone()[0]
    started = time.perf_counter()
    posting_s = post_many(url, "/api/v1/jobs", TRIVIAL, auth, count)
    print(f"    (all {count} POSTs answered after {posting_s:.2f} s, 32 connections)")
    with sqlite3.connect(ledger) as db:
        while True:
            accepted = db.execute(
                "SELECT count(*) FROM job WHERE name = ? AND external_id IS NOT NULL", (TRIVIAL["name"],)
            ).fetchone()[0]
            if accepted >= already + count:
                break
            time.sleep(0.01)
    elapsed = time.perf_counter() - started
    with sqlite3.connect(ledger) as db:
        refused = db.execute("SELECT count(*) FROM job WHERE state = 'failed'").fetchone()[0]
        query = "SELECT external_id FROM job WHERE name = ? ORDER BY id"
        ids = [row[0] for row in db.execute(query, (TRIVIAL["name"],))][already:]
    if refused:
        raise SystemExit(f"{refused} jobs were refused by SLURM")
    sizes = sorted(Counter(one.split("_")[0] for one in ids).values(), reverse=True)
    print(f"    ({len(sizes)} sbatch calls, of {', '.join(str(n) for n in sizes)} jobs)")
    return elapsed


def torchyard_ddp(client: httpx.Client) -> float:
    return time_job(client, DDP)


def submitit_ddp(folder: Path, n: int) -> float:
    spec = RunSpec(job_id=n, name="raw-submitit", entrypoint="worker.tasks.seed:ddp_parameters",
                   resources=Resources(tasks_per_node=3, timeout_min=5), folder=str(folder / f"raw-{n}"))
    executor = submitit.AutoExecutor(folder=spec.files.submitit, cluster="slurm")
    executor.update_parameters(nodes=1, tasks_per_node=3, cpus_per_task=1, timeout_min=5,
                               slurm_srun_args=["--kill-on-bad-exit=1"], slurm_setup=RAW_SETUP)
    started = time.perf_counter()
    job = executor.submit(RankLauncher(spec.model_dump_json()))
    result = job.results()[0]  # one value per task; rank 0's first
    elapsed = time.perf_counter() - started
    if not result["ok"]:
        raise SystemExit(f"raw submitit job did not check out: {result}")
    return elapsed


def calls_per_interval(tmp: Path, active: int, seconds: float = 8.0) -> tuple[int, int]:
    array = sh("sbatch", "--parsable", "--hold", f"--array=0-{active - 1}", "-J", "bench-held",
               "-o", "/dev/null", "--wrap", "true").strip().split(";")[0]
    settings = Settings(default_backend="slurm", data_dir=tmp / "calls", reconcile_interval_s=1)
    runtime = Runtime.build(settings)
    try:
        with session_scope(runtime.engine) as session:
            for index in range(active):
                session.add(Job(name=f"held-{index}", backend="slurm", state=JobState.submitted,
                                external_id=f"{array}_{index}", folder=str(tmp / "held" / str(index)),
                                spec={"entrypoint": "worker.tasks.faults:sleep", "resources": {}}))
        backend = runtime.backends["slurm"]
        assert isinstance(backend, SlurmBackend)
        runtime.reconciler.start()
        time.sleep(2)  # the first ticks move them submitted -> pending
        calls, ticks = backend.scheduler_calls, runtime.reconciler.ticks["slurm"]
        time.sleep(seconds)
        return backend.scheduler_calls - calls, runtime.reconciler.ticks["slurm"] - ticks
    finally:
        runtime.reconciler.stop()
        runtime.engine.dispose()
        subprocess.run(["scancel", array], check=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3, help="Rounds of (a) and of (b).")
    parser.add_argument("--active", type=int, default=1000)
    parser.add_argument("--parts", default="abc", help="Which of (a), (b), (c) to run, e.g. --parts a.")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torchyard-bench-") as name:
        tmp = Path(name)
        ledger = tmp / "ledger.db"
        env = {
            "TORCHYARD_DATA_DIR": str(tmp / "data"),
            "TORCHYARD_DATABASE_URL": f"sqlite:///{ledger}",
            "TORCHYARD_DEFAULT_BACKEND": "slurm",
            "TORCHYARD_RECONCILE_INTERVAL_S": "1",
        }
        with (
            torchyard("service.app:create_app", env) as (url, auth),
            httpx.Client(base_url=url, timeout=60, headers=auth) as client,
        ):
            if "a" in args.parts:
                dispatch_rate(client, url, auth, ledger, args.jobs, args.rounds)
            if "b" in args.parts:
                ddp_rounds(client, tmp, args.rounds)
        if "c" in args.parts:
            calls, ticks = calls_per_interval(tmp, args.active)
            print(f"(c) {args.active} active jobs: {calls} scheduler calls in {ticks} reconcile intervals "
                  f"= {calls / max(ticks, 1):.2f} per interval (target 1)")


def dispatch_rate(
    client: httpx.Client, url: str, auth: dict[str, str], ledger: Path, jobs: int, rounds: int
) -> None:
    """(a), under a blocker so that nothing runs on either side; the median ratio of `rounds` rounds,
    each an sbatch loop and then torchyard, so that a noisy moment of the machine hits both."""
    client.post("/api/v1/jobs", json=TRIVIAL).raise_for_status()  # warm: validation cache
    ratios: list[float] = []
    for n in range(rounds):
        with blocker():
            loop_s = sbatch_loop(jobs)
            ours_s = torchyard_dispatch(url, auth, ledger, jobs + 1)
            subprocess.run(["scancel", "-n", str(TRIVIAL["name"])], check=False)
        loop_rate, ours_rate = jobs / loop_s, (jobs + 1) / ours_s
        ratios.append(ours_rate / loop_rate)
        print(f"(a) round {n + 1}: sbatch loop {jobs} jobs in {loop_s:.2f} s = {loop_rate:.0f} jobs/s; "
              f"torchyard {jobs + 1} jobs POSTed -> accepted by SLURM in {ours_s:.2f} s "
              f"= {ours_rate:.0f} jobs/s; ratio {ratios[-1]:.2f}x")
        while squeue_ids(str(TRIVIAL["name"])):
            time.sleep(0.5)
    print(f"    ratio torchyard / sbatch loop, median of {rounds}: {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}; target >= 3x)")


def ddp_rounds(client: httpx.Client, tmp: Path, rounds: int) -> None:
    """(b) a tiny 3-rank DDP job, alternated with raw submitit."""
    ours: list[float] = []
    theirs: list[float] = []
    torchyard_ddp(client)  # warm the page cache for both alike
    for n in range(rounds):
        theirs.append(submitit_ddp(tmp, n))
        ours.append(torchyard_ddp(client))
        print(f"(b) round {n + 1}: raw submitit {theirs[-1]:.2f} s   torchyard {ours[-1]:.2f} s")
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"    ratio torchyard / raw submitit = {ratio:.2f}x (target <= 1.0x)")


if __name__ == "__main__":
    main()
