"""Restarts in place on the real SLURM cluster, with its third node n3 as a spare (issue 44).

- 2 nodes + 1 spare: a node that runs a rank, not the batch host, marked down mid-run: the supervisor
  leaves it out, takes the spare, and the job ends `succeeded` in its first attempt, under the same
  SLURM job id, with the parameters of an uninterrupted run bit for bit.
- The batch host marked down: SLURM ends the allocation with it; `retries` requeues the job, which
  still ends bit for bit, and the first attempt's reason names the node.
- No spare and a lost node: the attempt goes back to the queue, and the reason says why.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.app import create_app
from tests.integration.slurm.conftest import Api
from tests.integration.slurm.test_service_slurm import scancel_ours, settings_for
from tests.serving import LiveServer, serve
from tests.support import issue_token, wait_for

pytestmark = pytest.mark.slurm

TRAIN = "worker.tasks.train:train"
KWARGS = {"epochs": 4, "samples": 256, "batch_size": 32, "seed": 7, "report_every": 1}
SLOW = {**KWARGS, "sleep_per_step": 0.3}
TWO_NODES = {"nodes": 2, "tasks_per_node": 1, "timeout_min": 5}
RETRIES = {"max": 1, "backoff_s": 1, "backoff_factor": 1}


@pytest.fixture(scope="module")
def spare_cluster(three_nodes: list[str]) -> list[str]:
    return three_nodes


@pytest.fixture
def api(spare_cluster: list[str], tmp_path: Path) -> Iterator[Api]:
    server: LiveServer
    with serve(create_app(settings_for(tmp_path))) as server:
        yield Api(server.url, issue_token(server.runtime.engine, "alice"))
        scancel_ours(server)


def restart_records(job: dict[str, Any]) -> list[dict[str, Any]]:
    path = Path(job["folder"]) / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def running_with_checkpoint(api: Api, job_id: int) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        job = api.job(job_id)
        placed = job["state"] == "running" and len(job["placement"] or []) == 2
        return job if job["latest_checkpoint"] and placed else None

    return wait_for(probe, 180, f"job {job_id}'s first checkpoint")


def mark_down(node: str) -> float:
    subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test_restarts_slurm"],
                   check=True, timeout=30, capture_output=True)  # fmt: skip
    return time.time()


def reference_checksum(api: Api) -> str:
    """The same training, uninterrupted, world size 2, on the local backend (gloo on CPU sums the same)."""
    whole = api.submit(name="whole", entrypoint=TRAIN, backend="local", kwargs=KWARGS,
                       resources={"tasks_per_node": 2})["id"]  # fmt: skip
    done = api.finished(whole, timeout=240)
    assert done["state"] == "succeeded", done["reason"]
    return str(done["result"]["param_checksum"])


def first_step_after(job: dict[str, Any], since: float) -> float:
    lines = (Path(job["folder"]) / "progress.jsonl").read_text().splitlines()
    times = [r["time"] for line in lines if "step" in (r := json.loads(line)) and "checkpoint" not in r]
    return min(t for t in times if t > since)


def test_a_node_marked_down_mid_run_is_replaced_by_the_spare_in_place_bit_for_bit(api: Api) -> None:
    job_id = api.submit(name="spare", entrypoint=TRAIN, kwargs=SLOW,
                        resources={**TWO_NODES, "spare_nodes": 1})["id"]  # fmt: skip
    job = running_with_checkpoint(api, job_id)
    rank1 = next(p["host"] for p in job["placement"] if p["rank"] == 1)
    assert rank1 != "n1"  # the batch host runs rank 0
    down_at = mark_down(rank1)

    done = api.finished(job_id, timeout=300)
    reference = reference_checksum(api)

    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 1 and done["external_id"] == job["external_id"]  # no trip through the queue
    assert done["result"]["param_checksum"] == reference  # bit for bit
    assert done["result"]["resumed_from_epoch"] is not None
    [record] = restart_records(done)
    assert (record["outcome"], record["cause"], record["node"], record["rank"]) == (
        "restarted", "node_failure", rank1, 1)
    assert rank1 not in record["nodes"] and len(record["nodes"]) == 2
    assert sorted(p["host"] for p in done["placement"]) == sorted(record["nodes"])
    took = first_step_after(done, record["started_at"]) - down_at
    print(f"\n{rank1} marked down: restarted on {record['nodes']}, first step {took:.1f} s after")
    assert took <= 20.0


def test_the_batch_host_marked_down_ends_the_allocation_and_retries_requeue_it(api: Api) -> None:
    job_id = api.submit(name="batch-host", entrypoint=TRAIN, kwargs=SLOW, retries=RETRIES,
                        resources={**TWO_NODES, "spare_nodes": 1})["id"]  # fmt: skip
    job = running_with_checkpoint(api, job_id)
    batch_host = next(p["host"] for p in job["placement"] if p["rank"] == 0)
    mark_down(batch_host)

    done = api.finished(job_id, timeout=300)
    reference = reference_checksum(api)

    first = api.get(f"/api/v1/jobs/{job_id}/attempts").raise_for_status().json()[0]
    print(f"\nattempt 1: {first['kind']}: {first['reason'][:300]}")
    assert (first["state"], first["kind"]) == ("failed", "node_failure"), first
    assert f"node {batch_host}, the batch host, was lost" in first["reason"]
    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 2 and done["external_id"] != job["external_id"]
    assert done["result"]["param_checksum"] == reference


def test_a_lost_node_without_a_spare_goes_back_to_the_queue_saying_why(api: Api) -> None:
    job_id = api.submit(name="no-spare", entrypoint=TRAIN, kwargs=SLOW, retries=RETRIES,
                        resources=TWO_NODES)["id"]  # fmt: skip
    job = running_with_checkpoint(api, job_id)
    rank1 = next(p["host"] for p in job["placement"] if p["rank"] == 1)
    mark_down(rank1)

    done = api.finished(job_id, timeout=300)

    first = api.get(f"/api/v1/jobs/{job_id}/attempts").raise_for_status().json()[0]
    [gave_up] = restart_records(job)[:1]
    print(f"\nattempt 1: {first['kind']}: {first['reason'][:300]}")
    assert gave_up["outcome"] == "gave_up"
    assert gave_up["reason"] == "no spare node: the allocation holds 1 usable node of 2 needed"
    assert (first["state"], first["kind"]) == ("failed", "node_failure"), first
    assert "no spare node" in first["reason"], first["reason"]
    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 2
