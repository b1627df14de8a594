"""Stacks on demand on the real 2-node cluster: one `scancel --signal=URG` as the job's account reaches
every rank of submitit's srun step on both nodes. Rank 1 of 4 or 8 (2 nodes x 2 or 4 tasks) sleeps in the
job's own `stuck` while the others wait in all_reduce: the route names rank 1 and its line, groups
the other three, and gives each rank its node."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.hung_job import (
    STUCK_LINE,
    ended,
    hung_capture,
    place_script,
    submit_hang,
    timed_captures,
)
from tests.integration.isolation import isolated_settings, live_service
from tests.integration.slurm.conftest import scancel

pytestmark = pytest.mark.slurm


@pytest.mark.parametrize("tasks_per_node", [2, 4])  # 4 and 8 ranks
def test_a_hung_rank_on_two_nodes_is_named_and_the_others_grouped(
    shared_root: Path, tasks_per_node: int
) -> None:
    world = 2 * tasks_per_node
    script = place_script(shared_root)
    external_id = None
    try:
        settings = isolated_settings(shared_root, "slurm")
        with live_service(settings) as server, server.client("alice") as alice:
            job_id = submit_hang(alice, script, nodes=2, tasks_per_node=tasks_per_node)
            capture = hung_capture(alice, job_id, world=world)
            external_id = alice.get(f"/api/v1/jobs/{job_id}").json()["external_id"]
            measured = timed_captures(alice, job_id)
            with server.client("bob") as bob:
                others = bob.get(f"/api/v1/jobs/{job_id}/stacks")
            assert alice.post(f"/api/v1/jobs/{job_id}/cancel").status_code == 200
            ended(alice, job_id)
            after = alice.get(f"/api/v1/jobs/{job_id}/stacks")
    finally:
        scancel([external_id])

    groups = [group["ranks"] for group in capture["groups"]]
    assert groups[0] == [1] and [rank for rank in range(world) if rank != 1] in groups
    assert f"hang_rank.py:{STUCK_LINE} stuck" in capture["summary"]
    hosts = {rank["rank"]: rank["host"] for rank in capture["ranks"]}
    assert set(hosts.values()) == {"n1", "n2"}  # ranks on both nodes answered
    assert all(took < 3.5 for _, took in measured)
    assert others.status_code == 404
    assert after.status_code == 200 and after.json()["fresh"] is False
