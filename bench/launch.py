"""The seed's 3-rank DDP step: a torchyard job (POST -> succeeded) against torchrun, alternated.

torchrun --standalone --nproc_per_node=3 runs the same entrypoint through the same launcher, so the
difference is what each launcher adds. Target: torchyard at most 0.6x torchrun.

Run: .venv/bin/python -m bench.launch [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.harness import ROOT, time_job, torchyard

JOB: dict[str, object] = {
    "name": "bench-ddp",
    "entrypoint": "worker.tasks.seed:ddp_parameters",
    "resources": {"tasks_per_node": 3},
}


def time_torchrun(folder: Path) -> float:
    """One torchrun of the seed step. A run that fails is shown and timed again, once: torchrun's
    own rendezvous here aborts a rank now and then (SIGABRT), and the baseline must not end the bench."""
    for attempt in (1, 2):
        elapsed, failure = _torchrun_once(folder / f"try-{attempt}")
        if failure is None:
            return elapsed
        print(f"    torchrun failed, attempt {attempt} of 2:\n{failure}", file=sys.stderr)
    raise SystemExit("torchrun failed twice in a row")


def _torchrun_once(folder: Path) -> tuple[float, str | None]:
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    started = time.perf_counter()
    done = subprocess.run(
        [
            torchrun,
            "--standalone",
            "--nproc_per_node=3",
            str(ROOT / "bench" / "torchrun_seed.py"),
            str(folder),
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - started
    if done.returncode == 0:
        return elapsed, None
    # The ranks' own lines, not the launcher's warnings and tracebacks.
    lines = [line for line in done.stderr.splitlines() if not line.startswith(("W", "  File"))]
    return elapsed, f"exit {done.returncode}\n" + "\n".join(lines[:60])


def time_torchyard(client: httpx.Client) -> float:
    return time_job(client, JOB)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ours: list[float] = []
    theirs: list[float] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        torchyard("service.app:create_app", {"TORCHYARD_DATA_DIR": tmp}) as (url, auth),
        httpx.Client(base_url=url, timeout=30, headers=auth) as client,
    ):
        time_torchyard(client)  # warm the page cache for both sides alike
        for round_number in range(args.rounds):
            theirs.append(time_torchrun(Path(tmp) / f"torchrun-{round_number}"))
            ours.append(time_torchyard(client))
            print(f"round {round_number + 1}: torchrun {theirs[-1]:.2f} s   torchyard {ours[-1]:.2f} s")
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"median: torchrun {statistics.median(theirs):.2f} s   torchyard {statistics.median(ours):.2f} s")
    print(f"ratio torchyard / torchrun = {ratio:.2f}x (target <= 0.6x)")


if __name__ == "__main__":
    main()
