"""What the stacks tests share (local and SLURM): the hang script (tests/data/hang_rank.py) put where
the service allows scripts, submitted as alice, and the stacks route asked until every rank answered."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from service.states import TERMINAL_STATE_NAMES
from tests.support import ROOT, wait_for

log = logging.getLogger(__name__)

HANG = ROOT / "tests" / "data" / "hang_rank.py"
LINES = HANG.read_text().splitlines()
STUCK_LINE = next(n for n, line in enumerate(LINES, 1) if "# the stuck line" in line)
REGEX_LINE = next(n for n, line in enumerate(LINES, 1) if "# the regex line" in line)


def place_script(root: Path) -> Path:
    """hang_rank.py in the shared root's allowed script folder, readable by every account."""
    script = root / "scripts" / HANG.name
    shutil.copyfile(HANG, script)
    script.chmod(0o644)
    return script


def submit_hang(client: httpx.Client, script: Path, *args: str, **resources: int) -> int:
    body = {"name": "hang", "script": str(script), "args": list(args),
            "resources": {"timeout_min": 5, **resources}, "retries": {"max": 0}}  # fmt: skip
    response = client.post("/api/v1/jobs", json=body)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def stuck_frame(capture: dict[str, Any], rank: int, function: str = "stuck") -> dict[str, Any] | None:
    """`rank`'s frame in hang_rank.py's `function` (`stuck`), if its stacks hold one."""
    for one in capture["ranks"]:
        if one["rank"] != rank:
            continue
        for thread in one["threads"]:
            for frame in thread["frames"]:
                if frame["function"] == function and frame["file"].endswith(HANG.name):
                    return dict(frame)
    return None


def waiting_in_all_reduce(capture: dict[str, Any], rank: int) -> bool:
    one = next(r for r in capture["ranks"] if r["rank"] == rank)
    return any(f["function"] == "all_reduce" for t in one["threads"] for f in t["frames"])


def hung_capture(
    client: httpx.Client,
    job_id: int,
    world: int,
    timeout: float = 240,
    waiting: Callable[[dict[str, Any], int], bool] | None = None,
    function: str = "stuck",
) -> dict[str, Any]:
    """Ask for the stacks until rank 1 is in `stuck` and every other rank waits in all_reduce (the
    ranks start torch first: a capture before that finds them importing); `waiting` tells what the
    other ranks show instead."""
    waiting = waiting or waiting_in_all_reduce

    def probe() -> dict[str, Any] | None:
        response = client.get(f"/api/v1/jobs/{job_id}/stacks", timeout=60)
        if response.status_code == 409:  # not running yet
            state = client.get(f"/api/v1/jobs/{job_id}").json()["state"]
            assert state not in TERMINAL_STATE_NAMES, f"the hang job ended: {state}"
            time.sleep(1)
            return None
        assert response.status_code == 200, response.text
        capture: dict[str, Any] = response.json()
        others = [rank for rank in range(world) if rank != 1]
        if stuck_frame(capture, 1, function) and all(waiting(capture, rank) for rank in others):
            return capture
        time.sleep(1)
        return None

    return wait_for(probe, timeout, f"job {job_id}'s ranks to hang")


def timed_captures(client: httpx.Client, job_id: int, times: int = 3) -> list[tuple[float, float]]:
    """(seconds the request took, the capture's own took_s) for a few captures of a hung job."""
    measured = []
    for _ in range(times):
        started = time.monotonic()
        response = client.get(f"/api/v1/jobs/{job_id}/stacks", timeout=60)
        wall = time.monotonic() - started
        assert response.status_code == 200, response.text
        measured.append((wall, float(response.json()["took_s"])))
    log.warning("stacks capture of job %d: (request s, capture s) %s", job_id, measured)
    print(f"\nstacks capture of job {job_id}: (request s, capture s) {measured}")
    return measured


def ended(client: httpx.Client, job_id: int, timeout: float = 120) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        job: dict[str, Any] = client.get(f"/api/v1/jobs/{job_id}").json()
        return job if job["state"] in TERMINAL_STATE_NAMES else None

    return wait_for(probe, timeout, f"job {job_id} to end")
