"""GPU visibility on a real GPU: rank 0 of a training job on CUDA reports its GPU's utilisation and
memory (worker.gpu_stats, through NVML or nvidia-smi) among its metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
submitit = pytest.importorskip("submitit")

from worker.gpu_stats import read_nvidia_smi  # noqa: E402
from worker.launch import RankLauncher  # noqa: E402
from worker.spec import RunSpec  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_a_training_run_on_cuda_reports_its_gpu(tmp_path: Path) -> None:
    spec = RunSpec.model_validate(
        {
            "job_id": 1,
            "name": "gpu-metrics",
            "entrypoint": "worker.tasks.train:train",
            "folder": str(tmp_path),
            "kwargs": {"epochs": 3, "samples": 2048, "report_every": 1, "sleep_per_step": 0.02},
            "resources": {"tasks_per_node": 1, "gpus_per_node": 1, "timeout_min": 5},
            "rendezvous_timeout_s": 120,
        }
    )
    executor = submitit.AutoExecutor(folder=spec.files.submitit, cluster="local")
    executor.update_parameters(timeout_min=5, tasks_per_node=1, gpus_per_node=1)
    executor.submit(RankLauncher(spec)).results()

    lines = [json.loads(line) for line in spec.files.progress.read_text().splitlines()]
    gpu = [line["metrics"] for line in lines if "gpu0_mem_used_mib" in line.get("metrics", {})]
    assert gpu, "no progress line carried a GPU sample"
    assert all(0 <= m["gpu0_util_pct"] <= 100 and m["gpu0_mem_used_mib"] > 0 for m in gpu)


def test_nvidia_smi_answers_in_the_format_the_parser_reads() -> None:
    samples = read_nvidia_smi(["0"])
    assert len(samples) == 1 and samples[0].mem_total_mib > 1024
