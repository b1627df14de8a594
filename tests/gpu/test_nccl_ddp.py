"""NCCL DDP through the real launcher: 2 ranks on 2 GPUs, or 1 rank (NCCL world size 1) on one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
submitit = pytest.importorskip("submitit")

from worker.launch import RankLauncher  # noqa: E402
from worker.spec import RunSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("entrypoint", ["worker.tasks.seed:ddp_parameters",
                                        "worker.tasks.seed:sampler_shards"])
def test_seed_demonstrations_on_nccl(tmp_path: Path, entrypoint: str) -> None:
    ranks = min(2, torch.cuda.device_count())
    spec = RunSpec.model_validate({
        "job_id": 1, "name": "nccl", "entrypoint": entrypoint, "folder": str(tmp_path),
        "resources": {"tasks_per_node": ranks, "gpus_per_node": ranks, "timeout_min": 5},
        "rendezvous_timeout_s": 120,
    })
    executor = submitit.AutoExecutor(folder=spec.files.submitit, cluster="local")
    executor.update_parameters(timeout_min=5, tasks_per_node=ranks, gpus_per_node=ranks)
    executor.submit(RankLauncher(spec)).results()
    value = json.loads(spec.files.result.read_text())["value"]
    assert value["ok"], value
    assert value["world_size"] == ranks
    if "backend" in value:
        assert value["backend"] == "nccl"
