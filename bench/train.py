"""Training throughput: worker.tasks.train:train on 3 ranks as a torchyard job against the same loop
in a plain torchrun script (bench/torchrun_train.py), alternated in the same run, several rounds.

Both measure samples/s over their epochs alone (process start and rendezvous are bench.launch's
business); the model is big enough that the step, not the bookkeeping, takes the time. The job
reports every step (the most report() a task does) and checkpoints every epoch; its result says how
long those took, shown per step. Target: torchyard >= 0.97x torchrun.

Run (the machine is shared: under the heavy lock): .venv/bin/python -m bench.train [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.harness import ROOT, run_job, torchyard

LOOP = {"epochs": 3, "samples": 12288, "batch_size": 64, "lr": 0.01, "width": 512, "depth": 3}
JOB: dict[str, object] = {
    "name": "bench-train",
    "entrypoint": "worker.tasks.train:train",
    "kwargs": {**LOOP, "report_every": 1},
    "resources": {"tasks_per_node": 3, "timeout_min": 10},
}


def torchrun_round(folder: Path) -> dict[str, Any]:
    folder.mkdir(parents=True)
    out = folder / "timing.json"
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    done = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node=3", str(ROOT / "bench" / "torchrun_train.py"), str(out),
         json.dumps(LOOP)],
        check=False, cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"torchrun failed ({done.returncode}):\n{done.stderr[-3000:]}")
    timing: dict[str, Any] = json.loads(out.read_text())
    return timing


def torchyard_round(client: httpx.Client) -> dict[str, Any]:
    timing: dict[str, Any] = run_job(client, JOB)["result"]["timing"]
    return timing


def rate(timing: dict[str, Any]) -> float:
    return float(timing["samples"]) / float(timing["epochs_s"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ours: list[dict[str, Any]] = []
    theirs: list[dict[str, Any]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        torchyard("service.app:create_app", {"TORCHYARD_DATA_DIR": tmp}) as (url, auth),
        httpx.Client(base_url=url, timeout=30, headers=auth) as client,
    ):
        for round_number in range(args.rounds):
            theirs.append(torchrun_round(Path(tmp) / f"torchrun-{round_number}"))
            ours.append(torchyard_round(client))
            print(f"round {round_number + 1}: torchrun {rate(theirs[-1]):.0f} samples/s   "
                  f"torchyard {rate(ours[-1]):.0f} samples/s")  # fmt: skip
    mine, base = statistics.median(rate(t) for t in ours), statistics.median(rate(t) for t in theirs)
    steps = sum(t["steps"] for t in ours)
    print(f"median: torchrun {base:.0f} samples/s   torchyard {mine:.0f} samples/s")
    print(f"ratio torchyard / torchrun = {mine / base:.3f}x (target >= 0.97x)")
    per_step = {kind: 1000 * sum(t[kind] for t in ours) / steps for kind in ("report_s", "checkpoint_s")}
    step_ms = 1000 * sum(t["epochs_s"] for t in ours) / steps
    print(f"per step (rank 0, {steps} steps): {step_ms:.2f} ms in all, "
          f"report() {per_step['report_s']:.3f} ms, "
          f"checkpointing {per_step['checkpoint_s']:.3f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
