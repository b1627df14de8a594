"""The seed's 3-rank DDP step under torchrun: the same entrypoint torchyard runs, started by torchrun.

torchrun --standalone --nproc_per_node=3 bench/torchrun_seed.py FOLDER
"""

from __future__ import annotations

import sys

from worker.launch import RankLauncher
from worker.spec import Resources, RunSpec

if __name__ == "__main__":
    spec = RunSpec(
        job_id=1,
        name="torchrun-baseline",
        entrypoint="worker.tasks.seed:ddp_parameters",
        resources=Resources(tasks_per_node=3),
        folder=sys.argv[1],
    )
    result = RankLauncher(spec)()
    if not result["ok"]:
        raise SystemExit(f"seed check failed: {result}")
