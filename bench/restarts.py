"""Restarts in place against the trip through the queue, and goodput under repeated losses.

(a) local: a 3-rank worker.tasks.train job loses rank 1 (kill -9) after its first checkpoint: seconds
    from the kill to the first step after the restart in place; against the same job with restarts
    off and `retries` with no backoff (the requeue path, on an empty queue), in the same run.
    Target: <= 10 s, and >= 3x faster than the requeue.
(b) SLURM (the cluster of deploy/slurm, brought to 3 nodes here and back to 2 after): 2 nodes + 1
    spare, rank 1's node marked down: seconds from `scontrol update ... state=down` to the first step
    after the restart, against restarts off + retries with no backoff (a new sbatch). Target: <= 20 s,
    >= 3x faster.
(c) goodput: a run of --minutes (10) on 3 local ranks losing a rank every --every seconds (120),
    restarts max high enough: the job's goodput ratio (training / wall time) when it ends. Target:
    >= 90%.

Run: .venv/bin/python -m bench.restarts [--parts abc] [--rounds 3] [--minutes 10] [--every 120]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from bench.harness import ROOT, torchyard
from service.cli.render import goodput_parts
from service.states import TERMINAL_STATE_NAMES
from worker.spec import JobFiles, parse_placement

TRAIN = "worker.tasks.train:train"
KWARGS = {"epochs": 6, "samples": 192, "batch_size": 16, "seed": 5, "report_every": 1, "sleep_per_step": 0.2}
NO_BACKOFF = {"max": 1, "backoff_s": 0, "backoff_factor": 1}


def job(client: httpx.Client, job_id: int) -> dict[str, Any]:
    found: dict[str, Any] = client.get(f"/api/v1/jobs/{job_id}").raise_for_status().json()
    return found


def wait(what: str, probe: Callable[[], Any], timeout: float = 300) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := probe():
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def ended(client: httpx.Client, job_id: int) -> dict[str, Any]:
    done: dict[str, Any] = wait(
        f"job {job_id} to end", lambda: (j := job(client, job_id))["state"] in TERMINAL_STATE_NAMES and j
    )
    if done["state"] != "succeeded":
        raise SystemExit(f"job {job_id} did not succeed: {done['reason']}")
    return done


def rank_pid(job: dict[str, Any], rank: int) -> int | None:
    """The process of `rank` of this attempt of `job`, as its placement file names it."""
    try:
        text = JobFiles(Path(job["folder"])).placement(rank).read_text()
    except OSError:
        return None
    placed = parse_placement(text, job["attempt"])
    return placed.pid if placed is not None else None


def steps_after(folder: str, since: float) -> list[float]:
    """When rank 0 reported its steps, after `since` (its progress file's own times)."""
    lines = (Path(folder) / "progress.jsonl").read_text().splitlines()
    times = []
    for line in lines:
        record = json.loads(line)
        if "checkpoint" not in record and isinstance(record.get("time"), float) and record["time"] > since:
            times.append(record["time"])
    return times


def checkpointed(client: httpx.Client, job_id: int, ranks: int) -> dict[str, Any]:
    """The job once it saved its first checkpoint and its `ranks` ranks said where they run."""
    found: dict[str, Any] = wait(
        "the first checkpoint",
        lambda: (j := job(client, job_id))["latest_checkpoint"] and len(j["placement"] or []) == ranks and j,
    )
    return found


def lose_rank_locally(client: httpx.Client, body: dict[str, Any]) -> float:
    """Submit, kill rank 1 after the first checkpoint; seconds from the kill to the next step."""
    job_id = client.post("/api/v1/jobs", json=body).raise_for_status().json()["id"]
    running = checkpointed(client, job_id, 3)
    pid = wait("rank 1's process", lambda: rank_pid(running, 1))
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    first = wait("a step after the loss", lambda: steps_after(running["folder"], killed))[0]
    ended(client, job_id)
    return float(first - killed)


def part_a(client: httpx.Client, rounds: int) -> None:
    base = {
        "name": "bench-restart",
        "entrypoint": TRAIN,
        "kwargs": KWARGS,
        "resources": {"tasks_per_node": 3},
    }
    in_place, requeued = [], []
    for round_number in range(rounds):
        in_place.append(lose_rank_locally(client, base))
        requeued.append(lose_rank_locally(client, {**base, "restarts": {"max": 0}, "retries": NO_BACKOFF}))
        print(
            f"  round {round_number + 1}: restart in place {in_place[-1]:.2f} s, requeue {requeued[-1]:.2f} s"
        )
    ours, theirs = statistics.median(in_place), statistics.median(requeued)
    print(
        f"(a) local, rank death -> first step after: in place {ours:.2f} s (target <= 10 s), requeue with no "
        f"backoff {theirs:.2f} s: {theirs / ours:.1f}x faster (target >= 3x)"
    )


@contextmanager
def three_nodes() -> Iterator[None]:
    up = ["bash", str(ROOT / "deploy" / "slurm" / "up.sh"), "--no-smoke", "--nodes"]
    subprocess.run([*up, "3"], check=True, capture_output=True, timeout=600)
    try:
        yield
    finally:
        subprocess.run([*up, "2"], check=True, capture_output=True, timeout=600)


def lose_node_on_slurm(client: httpx.Client, body: dict[str, Any]) -> float:
    job_id = client.post("/api/v1/jobs", json=body).raise_for_status().json()["id"]
    running = checkpointed(client, job_id, 2)
    node = next(p["host"] for p in running["placement"] if p["rank"] == 1)
    subprocess.run(
        ["scontrol", "update", f"nodename={node}", "state=down", "reason=bench.restarts"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    down = time.time()
    first = wait("a step after the loss", lambda: steps_after(running["folder"], down))[0]
    ended(client, job_id)
    return float(first - down)


def part_b(client: httpx.Client, rounds: int) -> None:
    resources = {"nodes": 2, "tasks_per_node": 1, "timeout_min": 10}
    base = {
        "name": "bench-spare",
        "entrypoint": TRAIN,
        "kwargs": {**KWARGS, "sleep_per_step": 0.3},
        "backend": "slurm",
        "resources": {**resources, "spare_nodes": 1},
    }
    in_place, requeued = [], []
    with three_nodes():
        for round_number in range(rounds):
            in_place.append(lose_node_on_slurm(client, base))
            requeued.append(
                lose_node_on_slurm(
                    client, {**base, "resources": resources, "restarts": {"max": 0}, "retries": NO_BACKOFF}
                )
            )
            print(
                f"  round {round_number + 1}: restart on the spare {in_place[-1]:.2f} s, "
                f"requeue {requeued[-1]:.2f} s"
            )
    ours, theirs = statistics.median(in_place), statistics.median(requeued)
    print(
        f"(b) SLURM, node down -> first step after: in place {ours:.2f} s (target <= 20 s), requeue with no "
        f"backoff {theirs:.2f} s: {theirs / ours:.1f}x faster (target >= 3x)"
    )


def part_c(client: httpx.Client, minutes: float, every_s: float) -> None:
    """A run of `minutes` from its first checkpoint on, a rank killed every `every_s`; then its goodput
    as the service gives it (the accruing part brought up to now), and the run is cancelled. Sized by
    time, not steps: the same losses on a fast machine and a slow one."""
    losses = int(-(-minutes * 60 // every_s)) - 1  # every `every_s` before the run's end: 4 in 10 minutes
    # Steps of 0.2 s and an epoch of 4 steps: a checkpoint every second or so; far more epochs than
    # the run lasts, so it is still training at its end.
    body = {
        "name": "bench-goodput",
        "entrypoint": TRAIN,
        "resources": {"tasks_per_node": 3, "timeout_min": 60},
        "restarts": {"max": losses + 2},
        "kwargs": {**KWARGS, "epochs": int(10 * minutes * 60)},
    }
    job_id = client.post("/api/v1/jobs", json=body).raise_for_status().json()["id"]
    running = checkpointed(client, job_id, 3)
    began = time.monotonic()
    for loss in range(losses):
        time.sleep(max(0.0, began + (loss + 1) * every_s - time.monotonic()))
        pid = wait("rank 1's process", lambda: rank_pid(running, 1))
        os.kill(pid, signal.SIGKILL)
        print(f"  {time.monotonic() - began:.0f} s: rank 1 killed (loss {loss + 1} of {losses})")
    time.sleep(max(0.0, began + minutes * 60 - time.monotonic()))
    now = job(client, job_id)
    parts = goodput_parts(now)
    client.post(f"/api/v1/jobs/{job_id}/cancel").raise_for_status()
    wall = sum(parts.values())
    print(
        f"(c) goodput of a {wall / 60:.1f}-minute run, a rank lost every {every_s:.0f} s "
        f"({now['restart_count']} restarts): {100 * parts['training'] / wall:.1f}% (target >= 90%); "
        f"training {parts['training']:.0f} s, downtime {parts['downtime']:.1f} s, recomputed "
        f"{parts['recomputed']:.1f} s, queue {parts['queue']:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="abc")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--every", type=float, default=120.0)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        torchyard(
            "service.app:create_app",
            {
                "TORCHYARD_DATA_DIR": tmp,
                "TORCHYARD_LOCAL_RECONCILE_INTERVAL_S": "0.2",
                "TORCHYARD_DISPATCH_INTERVAL_S": "0.2",
            },
        ) as (url, auth),
        httpx.Client(base_url=url, timeout=30, headers=auth) as client,
    ):
        if "a" in args.parts:
            part_a(client, args.rounds)
        if "b" in args.parts:
            part_b(client, args.rounds)
        if "c" in args.parts:
            part_c(client, args.minutes, args.every)


if __name__ == "__main__":
    main()
