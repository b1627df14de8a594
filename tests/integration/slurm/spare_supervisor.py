"""A stand-in for the supervisor (worker/supervisor.py, the lead's), for tests/integration/slurm/
test_spares_slurm.py: what submitit's running side calls once in the batch step of the script the
service writes. It runs two srun steps the way the supervisor will: the first on two nodes of the
allocation, which the test breaks by marking a node down; then, on the hosts worker.slurm_nodes still
calls usable, a second one. It reports what it saw; it decides nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from worker.slurm_nodes import SRUN_STEP_FLAGS, allocation_hosts, usable_hosts


def step(hosts: list[str], command: str) -> subprocess.CompletedProcess[str]:
    srun = os.environ["TORCHYARD_SRUN"]
    argv = [srun, f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
            f"--nodelist={','.join(hosts)}", *SRUN_STEP_FLAGS, "sh", "-c", command]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)


def supervise(folder: str) -> dict[str, Any]:
    """Step 1 on the batch host and the next host (each task writes `<folder>/up-<host>` and sleeps),
    then step 2 on the usable hosts; the times are the batch host's clock (one machine: the test's)."""
    job_id = os.environ["SLURM_JOB_ID"]
    hosts = allocation_hosts(os.environ)
    batch_host = socket.gethostname()
    first = usable_hosts(hosts, job_id, os.environ)[:2]
    began = time.time()
    one = step(first, f'hostname > "{folder}/up-$(hostname)"; sleep 120')
    one_ended = time.time()
    left = usable_hosts(hosts, job_id, os.environ)
    asked = time.time()
    two = step(left[:2], "hostname")
    return {
        "batch_host": batch_host,
        "allocation": hosts,
        "first": first,
        "step1_rc": one.returncode,
        "step1_stderr": one.stderr,
        "step1_s": one_ended - began,
        "step1_ended": one_ended,
        "usable_after": left,
        "step2_rc": two.returncode,
        "step2_hosts": sorted(two.stdout.split()),
        "usable_s": asked - one_ended,
        "step2_s": time.time() - asked,
        "step2_stderr": two.stderr,
        "step_env": {key: value for key, value in os.environ.items() if key.startswith("SLURM_")},
        "marker_dir": str(Path(folder)),
    }
