"""SlurmBackend against the real two-node cluster of deploy/slurm: sbatch through submitit (job arrays
included), the job's supervisor and its ranks, squeue/sacct status, scancel, and SLURM's own refusals."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from service.backends.base import BackendStatus
from service.backends.slurm import SlurmBackend
from service.errors import InvalidRequest
from service.states import JobState, is_terminal
from worker.spec import RunSpec

pytestmark = pytest.mark.slurm


def make(
    tmp_path: Path, job_id: int, entrypoint: str, kwargs: dict[str, Any] | None = None, **resources: Any
) -> RunSpec:
    return RunSpec.model_validate(
        {
            "job_id": job_id,
            "name": f"it-{job_id}",
            "entrypoint": entrypoint,
            "kwargs": kwargs or {},
            "folder": str(tmp_path / "jobs" / str(job_id)),
            "rendezvous_timeout_s": 60,
            "resources": {"timeout_min": 3, **resources},
        }
    )


def wait_until(
    slurm: SlurmBackend, ids: Sequence[str], done: Any, timeout: float = 150.0
) -> dict[str, BackendStatus]:
    """Poll every 0.5 s until done(statuses) holds; each poll must be ONE scheduler call."""
    deadline = time.monotonic() + timeout
    while True:
        before = slurm.scheduler_calls
        statuses = slurm.poll(ids)
        if len(statuses) == len(ids):
            assert slurm.scheduler_calls == before + 1  # squeue knows them all: no sacct needed
        if done(statuses):
            return statuses
        assert time.monotonic() < deadline, f"timed out; last statuses {statuses}"
        time.sleep(0.5)


def all_ended(statuses: dict[str, BackendStatus]) -> bool:
    return all(is_terminal(status.state) for status in statuses.values())


def test_a_batch_runs_through_rank_launcher(slurm: SlurmBackend, tmp_path: Path) -> None:
    specs = [
        make(tmp_path, 1, "worker.tasks.faults:hostnames", nodes=2, tasks_per_node=2),
        make(tmp_path, 2, "worker.tasks.faults:hostnames"),
        make(tmp_path, 3, "worker.tasks.faults:hostnames"),
        make(tmp_path, 4, "worker.tasks.faults:raise_on_rank", {"rank": 1}, tasks_per_node=2),
        make(tmp_path, 5, "worker.tasks.faults:hostnames", nodes=3),  # more nodes than the partition has
    ]
    outcomes = slurm.submit(specs)
    assert [o.job_id for o in outcomes] == [1, 2, 3, 4, 5]
    assert outcomes[4].error == "Node count specification invalid"  # SLURM's words, this job only
    ids = [str(o.external_id) for o in outcomes[:4]]
    assert all(outcome.accepted for outcome in outcomes[:4])
    array = ids[1].split("_")[0]
    assert ids[1:3] == [f"{array}_0", f"{array}_1"]  # the two equal jobs went out as one array

    final = wait_until(slurm, ids, all_ended)
    assert [final[one].state for one in ids] == [JobState.succeeded] * 3 + [JobState.failed]
    # srun reports its worst task: rank 1's 1, or 143 when --kill-on-bad-exit's SIGTERM reached rank 0
    # while it still ran (a race on 2 cores). The cause itself is checked in rank 1's error file below.
    assert final[ids[3]].exit_code in (1, 128 + 15)
    result = json.loads(specs[0].files.result.read_text())["value"]
    assert result["hostnames"] == ["n1", "n1", "n2", "n2"]  # rank order: two nodes, two ranks each
    assert final[ids[0]].nodes == "n[1-2]"
    for rank in range(4):
        assert slurm.log_path(specs[0].files.folder, ids[0], rank, "err").exists()
    for spec, one in zip(specs[1:3], ids[1:3], strict=True):
        # Each array element's files are in its own job folder, and only its own.
        assert json.loads(spec.files.result.read_text())["value"]["world_size"] == 1
        names = {path.name for path in spec.files.submitit.iterdir()}
        assert names == {
            f"{one}_submitted.pkl",
            f"{one}_0_log.out",
            f"{one}_0_log.err",
            f"{one}_0_result.pkl",
        }
    assert "deliberate failure (rank 1)" in specs[3].files.error(1).read_text()


def test_cancel_a_running_and_a_pending_job(slurm: SlurmBackend, tmp_path: Path) -> None:
    # Each asks for all 8 CPUs of the cluster, so the second must wait for the first.
    whole = {"nodes": 2, "tasks_per_node": 4}
    specs = [make(tmp_path, n, "worker.tasks.faults:sleep", {"seconds": 120}, **whole) for n in (1, 2)]
    ids = [str(o.external_id) for o in slurm.submit(specs)]
    assert len(ids) == 2
    try:
        cancel_both(slurm, ids)
    finally:
        slurm.cancel(ids)  # a failed assertion must not leave the cluster full for the next test


def cancel_both(slurm: SlurmBackend, ids: list[str]) -> None:
    first, second = ids

    def one_runs_one_waits(statuses: dict[str, BackendStatus]) -> bool:
        # The pending reason is "None" until the scheduler's next pass (sched_interval=2) sets it.
        return (
            len(statuses) == 2
            and statuses[first].state is JobState.running
            and (
                statuses[second].state is JobState.pending
                and statuses[second].reason in ("Resources", "Priority")
            )
        )

    wait_until(slurm, ids, one_runs_one_waits, timeout=60)
    slurm.cancel(ids)
    final = wait_until(slurm, ids, all_ended, timeout=60)
    assert [final[one].state for one in ids] == [JobState.cancelled, JobState.cancelled]
    slurm.cancel([*ids, "999999"])  # again, and an id SLURM never knew: not an error


@pytest.mark.parametrize(
    ("resources", "field", "words"),
    [
        ({"nodes": 3}, "resources.nodes", "Node count specification invalid"),
        ({"partition": "nosuch"}, "resources.partition", "invalid partition"),
        ({"timeout_min": 2000}, "resources.timeout_min", "time limit"),  # debug's MaxTime is one day
        ({"tasks_per_node": 9}, "resources.tasks_per_node", "More processors requested than permitted"),
    ],
)
def test_validate_gives_slurms_reason(
    slurm: SlurmBackend, tmp_path: Path, resources: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        slurm.validate(make(tmp_path, 1, "worker.tasks.faults:hostnames", **resources))
    assert refused.value.field == field
    assert words in refused.value.message


def test_validate_accepts_what_fits(slurm: SlurmBackend, tmp_path: Path) -> None:
    slurm.validate(
        make(tmp_path, 1, "worker.tasks.faults:hostnames", nodes=2, tasks_per_node=4, partition="debug")
    )
    assert slurm.scheduler_calls == 1
