"""A sweep of 200 trials on the real SLURM cluster of deploy/slurm, three ways, same run:

- torchyard, one sweep: one POST /api/v1/sweeps (a 20 x 10 grid) until all 200 trials are accepted
  by SLURM (each has its SLURM id in the ledger);
- torchyard, 200 separate POSTs of the same trial job (32 connections), until all are accepted;
- by hand: one `sbatch --array=0-199%<max_parallel>` of a script that maps SLURM_ARRAY_TASK_ID to its
  parameters, the way people write an array without a launcher, until sbatch answers;
- for reference, submitit's own `map_array` (what Hydra's submitit launcher calls), until it returns
  the jobs: the same grid, a pickle per trial in one shared folder, no ledger and no job folders.

A blocker job holds the whole cluster meanwhile, so nothing runs on any side; everything is
scancelled after each round. Targets: the sweep within 1.5x of the hand-written array's time, and at
least 5x faster than the separate POSTs.

Run: .venv/bin/python -m bench.sweep [--rounds 3] [--trials 200]
"""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import submitit

from bench.harness import post_many, torchyard
from bench.slurm import blocker, sh, squeue_ids

NAME = "bench-sweep"
MAX_PARALLEL = 4
JOB: dict[str, Any] = {
    "entrypoint": "worker.tasks.faults:sleep",
    "kwargs": {"seconds": 0},
    "resources": {"timeout_min": 1},
}


def grid(trials: int) -> dict[str, list[int]]:
    """`trials` combinations of two parameters (trials must be a multiple of 10)."""
    return {"lr_index": list(range(trials // 10)), "seed": list(range(10))}


def accepted(ledger: Path, since_id: int) -> int:
    with sqlite3.connect(ledger) as db:
        query = "SELECT count(*) FROM job WHERE id > ? AND external_id IS NOT NULL"
        return int(db.execute(query, (since_id,)).fetchone()[0])


def last_id(ledger: Path) -> int:
    with sqlite3.connect(ledger) as db:
        return int(db.execute("SELECT coalesce(max(id), 0) FROM job").fetchone()[0])


def wait_accepted(ledger: Path, since_id: int, count: int) -> None:
    while accepted(ledger, since_id) < count:
        time.sleep(0.005)


def arrays_of(ledger: Path, since_id: int) -> set[str]:
    """The SLURM jobs (arrays) that hold the jobs stored after `since_id`."""
    with sqlite3.connect(ledger) as db:
        ids = [row[0] for row in db.execute("SELECT external_id FROM job WHERE id > ?", (since_id,))]
    return {one.split("_")[0] for one in ids if one}


def queued(ids: list[str]) -> bool:
    """Whether SLURM still holds any of these jobs (squeue refuses ids it has forgotten: not an error)."""
    done = subprocess.run(["squeue", "-h", "-j", ",".join(ids), "-o", "%i"], capture_output=True, text=True)
    return bool(ids) and bool(done.stdout.strip())


def create_cost_us(folder: Path, count: int = 200) -> float:
    """CPU microseconds per mkdir in `folder`: the service makes four files a trial before its
    sbatch (two folders, a link, a pickle), the hand-written array one. What a create costs varies
    on one disk from 20 to 650 µs (ext4's search for a free inode), so the ratios mean little
    without it."""
    scratch = folder / "create-cost"
    scratch.mkdir()
    started = time.process_time()
    for index in range(count):
        (scratch / str(index)).mkdir()
    cost = (time.process_time() - started) / count * 1e6
    shutil.rmtree(scratch)
    return cost


def one_sweep(client: httpx.Client, ledger: Path, trials: int) -> float:
    since = last_id(ledger)
    body = {"name": NAME, "job": JOB, "grid": grid(trials), "max_parallel": MAX_PARALLEL}
    started = time.perf_counter()
    client.post("/api/v1/sweeps", json=body).raise_for_status()
    wait_accepted(ledger, since, trials)
    elapsed = time.perf_counter() - started
    print(f"    (sweep: {len(arrays_of(ledger, since))} sbatch call(s))")
    return elapsed


def separate_posts(url: str, auth: dict[str, str], ledger: Path, trials: int) -> float:
    since = last_id(ledger)
    started = time.perf_counter()
    post_many(url, "/api/v1/jobs", {"name": NAME, **JOB}, auth, trials)
    wait_accepted(ledger, since, trials)
    elapsed = time.perf_counter() - started
    print(f"    (separate POSTs: {len(arrays_of(ledger, since))} sbatch call(s))")
    return elapsed


def by_hand(folder: Path, trials: int) -> float:
    """What a person writes without a launcher: a script that picks its parameters by array index."""
    script = folder / "array.sh"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --job-name={NAME}-hand\n#SBATCH --output=/dev/null\n#SBATCH --time=1\n"
        f"#SBATCH --array=0-{trials - 1}%{MAX_PARALLEL}\n"
        "LR_INDEX=$((SLURM_ARRAY_TASK_ID / 10)); SEED=$((SLURM_ARRAY_TASK_ID % 10))\n"
        "exec python -c 'import time' --lr-index=$LR_INDEX --seed=$SEED\n"
    )
    started = time.perf_counter()
    sh("sbatch", "--parsable", str(script))
    return time.perf_counter() - started


def trial(lr_index: int, seed: int) -> int:
    """What submitit's map_array pickles for each trial (by reference: this module is importable)."""
    return lr_index * 10 + seed


def submitit_map_array(folder: Path, trials: int) -> float:
    executor = submitit.SlurmExecutor(folder / "submitit" / "%j")
    executor.update_parameters(
        job_name=f"{NAME}-submitit", time=1, array_parallelism=MAX_PARALLEL, stderr_to_stdout=True
    )
    lr_indexes = [n // 10 for n in range(trials)]
    seeds = [n % 10 for n in range(trials)]
    started = time.perf_counter()
    executor.map_array(trial, lr_indexes, seeds)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="torchyard-bench-") as name:
        tmp = Path(name)
        ledger = tmp / "ledger.db"
        env = {
            "TORCHYARD_DATA_DIR": str(tmp / "data"),
            "TORCHYARD_DATABASE_URL": f"sqlite:///{ledger}",
            "TORCHYARD_DEFAULT_BACKEND": "slurm",
            "TORCHYARD_RECONCILE_INTERVAL_S": "1",
            "TORCHYARD_MAX_ACTIVE_JOBS_PER_USER": str(args.trials * 2 * args.rounds + 10),  # scancelled too
        }
        with (
            torchyard("service.app:create_app", env) as (url, auth),
            httpx.Client(base_url=url, timeout=120, headers=auth) as client,
        ):
            client.post("/api/v1/jobs", json={"name": "warm", **JOB}).raise_for_status()  # validation cache
            rounds(client, url, auth, ledger, tmp, args.trials, args.rounds)


def rounds(
    client: httpx.Client, url: str, auth: dict[str, str], ledger: Path, tmp: Path, trials: int, count: int
) -> None:
    """Each round: by hand, submitit's map_array, one sweep, separate POSTs, under one blocker; the
    median ratios."""
    to_hand: list[float] = []
    to_posts: list[float] = []
    to_submitit: list[float] = []
    for n in range(count):
        print(f"    (a mkdir in the data folder's file system costs {create_cost_us(tmp):.0f} µs of CPU)")
        before = last_id(ledger)
        with blocker():
            hand_s = by_hand(tmp, trials)
            submitit_s = submitit_map_array(tmp, trials)
            sweep_s = one_sweep(client, ledger, trials)
            posts_s = separate_posts(url, auth, ledger, trials)
            # By id: a sweep's array is named after no one trial, and nothing of a round may run.
            ours = sorted(arrays_of(ledger, before))
            subprocess.run(["scancel", *ours], check=False)
            for side in ("hand", "submitit"):
                subprocess.run(["scancel", "-n", f"{NAME}-{side}"], check=False)
            while squeue_ids(f"{NAME}-hand") or squeue_ids(f"{NAME}-submitit") or queued(ours):
                time.sleep(0.5)
        to_hand.append(sweep_s / hand_s)
        to_posts.append(posts_s / sweep_s)
        to_submitit.append(sweep_s / submitit_s)
        print(f"round {n + 1}: by hand {hand_s:.3f} s; submitit map_array {submitit_s:.3f} s; "
              f"one sweep {sweep_s:.3f} s; {trials} POSTs {posts_s:.3f} s  ->  sweep / by hand "
              f"{to_hand[-1]:.2f}x, POSTs / sweep {to_posts[-1]:.2f}x, "
              f"sweep / map_array {to_submitit[-1]:.2f}x")  # fmt: skip
    hand, posts = statistics.median(to_hand), statistics.median(to_posts)
    print(f"median of {count}: sweep / hand-written array {hand:.2f}x (target <= 1.5x); "
          f"separate POSTs / sweep {posts:.2f}x (target >= 5x); "
          f"sweep / submitit map_array {statistics.median(to_submitit):.2f}x (no target)")  # fmt: skip


if __name__ == "__main__":
    main()
