"""The watchdog on the real 2-node cluster: rank 1 of 4 (2 nodes x 2 tasks, a script that reports
nothing) sleeps in the job's own `stuck` while the others wait in all_reduce. From the ranks'
activity files on the shared folder alone (no scheduler query of its own), the service flags the job
stalled within its threshold and a few seconds, naming rank 1, its node and its line, with the
stacks captured through one `scancel --signal=URG`."""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.integration.hung_job import STUCK_LINE, ended, place_script
from tests.integration.isolation import isolated_settings, live_service
from tests.integration.slurm.conftest import scancel
from tests.support import wait_for

pytestmark = pytest.mark.slurm

STALL_AFTER_S = 15


def test_a_hung_rank_on_two_nodes_is_flagged_stalled_naming_it(shared_root: Path) -> None:
    script = place_script(shared_root)
    external_id = None
    body = {"name": "hang", "script": str(script), "retries": {"max": 0},
            "watchdog": {"stall_after_s": STALL_AFTER_S},
            "resources": {"nodes": 2, "tasks_per_node": 2, "timeout_min": 5}}  # fmt: skip
    try:
        settings = isolated_settings(shared_root, "slurm")
        with live_service(settings) as server, server.client("alice") as alice:
            response = alice.post("/api/v1/jobs", json=body)
            assert response.status_code == 201, response.text
            job_id = int(response.json()["id"])

            def flagged() -> dict[str, Any] | None:
                job: dict[str, Any] = alice.get(f"/api/v1/jobs/{job_id}").json()
                return job if job["stalled_at"] else None

            job = wait_for(flagged, 240, f"job {job_id} stalled")
            external_id = job["external_id"]
            assert alice.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
            ended(alice, job_id)
    finally:
        scancel([external_id])

    reason = job["stall_reason"]
    print(f"\nflagged {job['stalled_at']} (started {job['started_at']}): {reason}")
    assert re.search(rf"rank 1 on n1 in \S*hang_rank\.py:{STUCK_LINE} stuck", reason), reason
    assert "ranks 0, 2, 3 wait in all_reduce" in reason, reason
    running_for = datetime.fromisoformat(job["stalled_at"]) - datetime.fromisoformat(job["started_at"])
    assert running_for.total_seconds() < STALL_AFTER_S + 60  # its start (torch imports) + the threshold
