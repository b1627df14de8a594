"""GPU sampling (worker.gpu_stats): nvidia-smi's CSV parsed, samples handed out once, and rank 0 of a
GPU job adding them to its progress lines. No GPU needed: the reader is replaced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker import gpu_stats
from worker.context import JobContext
from worker.distributed import RankEnv
from worker.gpu_stats import GpuSample, GpuSampler, as_metrics, parse_nvidia_smi
from worker.spec import RunSpec

DATA = Path(__file__).parents[2] / "data" / "gpu"


def test_nvidia_smi_rows_are_parsed_and_unreadable_ones_skipped() -> None:
    # The answer of nvidia-smi --query-gpu=index,utilization.gpu,memory.used,memory.total
    # --format=csv,noheader,nounits, written in its documented format (this machine has no GPU to
    # record from; tests/gpu/test_gpu_metrics.py reads the real one where there is).
    samples = parse_nvidia_smi((DATA / "nvidia_smi_query.txt").read_text())

    assert samples == [GpuSample(97.0, 61440.0, 143771.0), GpuSample(3.0, 523.0, 143771.0)]
    assert as_metrics(samples) == {
        "gpu0_util_pct": 97.0,
        "gpu0_mem_used_mib": 61440.0,
        "gpu1_util_pct": 3.0,
        "gpu1_mem_used_mib": 523.0,
    }


def test_each_sample_is_handed_out_once() -> None:
    readings = iter([[GpuSample(50.0, 100.0, 1000.0)], [GpuSample(60.0, 200.0, 1000.0)]])
    sampler = GpuSampler(lambda: next(readings))

    assert sampler.take() is None
    sampler.sample_once()
    assert sampler.take() == {"gpu0_util_pct": 50.0, "gpu0_mem_used_mib": 100.0}
    assert sampler.take() is None
    sampler.sample_once()
    assert sampler.take() == {"gpu0_util_pct": 60.0, "gpu0_mem_used_mib": 200.0}


def test_a_reader_that_fails_stops_sampling_instead_of_the_job() -> None:
    def broken() -> list[GpuSample]:
        raise FileNotFoundError("nvidia-smi")

    sampler = GpuSampler(broken, interval_s=0.01)
    sampler._run()  # returns: the failure stopped it

    assert sampler.take() is None


def test_rank_0_of_a_gpu_job_reports_its_gpus_with_the_next_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[tuple[str, ...]] = []

    def fake_for_gpus(gpus: tuple[str, ...], **_: object) -> GpuSampler:
        asked.append(tuple(gpus))
        return GpuSampler(lambda: [GpuSample(88.0, 4096.0, 81920.0)])

    monkeypatch.setattr(gpu_stats.GpuSampler, "for_gpus", staticmethod(fake_for_gpus))
    spec = RunSpec.model_validate({"job_id": 7, "name": "gpu", "entrypoint": "m:f", "folder": str(tmp_path)})
    env = RankEnv(0, 1, 0, 1, 0, "127.0.0.1", 20007, "local", "1", gpu=0, visible_gpus=("3",))
    ctx = JobContext(spec, env, backend="nccl", progress_interval_s=60)
    assert ctx._gpus is not None and asked == [("3",)]  # the physical GPU the job was given

    ctx._gpus.sample_once()
    ctx.report(1, loss=0.5)
    ctx.report(2, loss=0.4)  # no new sample since: no GPU metrics
    ctx.close()

    first, second = (json.loads(line)["metrics"] for line in ctx.files.progress.read_text().splitlines())
    assert first == {"loss": 0.5, "gpu0_util_pct": 88.0, "gpu0_mem_used_mib": 4096.0}
    assert second == {"loss": 0.4}


def test_cpu_jobs_sample_nothing(tmp_path: Path) -> None:
    spec = RunSpec.model_validate({"job_id": 7, "name": "cpu", "entrypoint": "m:f", "folder": str(tmp_path)})
    env = RankEnv(0, 1, 0, 1, 0, "127.0.0.1", 20007, "local", "1")
    assert JobContext(spec, env, progress_interval_s=60)._gpus is None
