"""GPU utilisation and memory of the job's GPUs, sampled by rank 0 in the background.

NVML (the `nvidia-ml-py` package, module `pynvml`) when it is importable, else one
`nvidia-smi --query-gpu` per sample. Sampling runs in a daemon thread every few seconds, so the
training step never waits for it; JobContext.report() adds the newest sample to the metrics of its
next progress line (a line of its own would replace the job's shown progress).
No torch here.
"""

from __future__ import annotations

import logging
import subprocess
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

QUERY = "index,utilization.gpu,memory.used,memory.total"
SMI_TIMEOUT_S = 10.0
DEFAULT_INTERVAL_S = 5.0


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one moment: utilisation in percent, memory in MiB."""

    util_pct: float
    mem_used_mib: float
    mem_total_mib: float


def parse_nvidia_smi(text: str) -> list[GpuSample]:
    """Rows of `nvidia-smi --query-gpu=QUERY --format=csv,noheader,nounits`, in the order asked.

    A value nvidia-smi cannot read prints as "[N/A]" (or "[Not Supported]"): that GPU's row is skipped."""
    samples: list[GpuSample] = []
    for line in text.splitlines():
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            util, used, total = (float(value) for value in fields[1:])
        except ValueError:
            continue
        samples.append(GpuSample(util_pct=util, mem_used_mib=used, mem_total_mib=total))
    return samples


def as_metrics(samples: Sequence[GpuSample]) -> dict[str, float]:
    """gpu<i>_util_pct and gpu<i>_mem_used_mib, i the GPU's place among the job's GPUs on this node."""
    metrics: dict[str, float] = {}
    for index, sample in enumerate(samples):
        metrics[f"gpu{index}_util_pct"] = sample.util_pct
        metrics[f"gpu{index}_mem_used_mib"] = sample.mem_used_mib
    return metrics


def read_nvidia_smi(gpus: Sequence[str]) -> list[GpuSample]:
    done = subprocess.run(
        ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-i", ",".join(gpus)],
        capture_output=True,
        text=True,
        timeout=SMI_TIMEOUT_S,
        check=True,
    )
    return parse_nvidia_smi(done.stdout)


def nvml_reader(gpus: Sequence[str]) -> Callable[[], list[GpuSample]] | None:
    """A reader through NVML for these GPUs (physical indices or UUIDs), or None without NVML."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
        handles = [
            pynvml.nvmlDeviceGetHandleByIndex(int(gpu))
            if gpu.isdigit()
            else pynvml.nvmlDeviceGetHandleByUUID(gpu)
            for gpu in gpus
        ]
    except Exception:  # not installed, no driver, an id NVML does not know: nvidia-smi's turn
        return None

    def read() -> list[GpuSample]:
        return [_nvml_sample(pynvml, handle) for handle in handles]

    return read


def _nvml_sample(pynvml: Any, handle: Any) -> GpuSample:
    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    mib = 1024 * 1024
    return GpuSample(
        util_pct=float(util.gpu), mem_used_mib=memory.used / mib, mem_total_mib=memory.total / mib
    )


class GpuSampler:
    """Samples `read()` every `interval_s` in a daemon thread; `take()` hands each sample out once."""

    def __init__(
        self, read: Callable[[], list[GpuSample]], *, interval_s: float = DEFAULT_INTERVAL_S
    ) -> None:
        self._read = read
        self.interval_s = interval_s
        self._latest: dict[str, float] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)

    @classmethod
    def for_gpus(cls, gpus: Sequence[str], *, interval_s: float = DEFAULT_INTERVAL_S) -> GpuSampler | None:
        """A started sampler of these GPUs (NVML, else nvidia-smi), or None when there are none."""
        if not gpus:
            return None
        read = nvml_reader(gpus) or (lambda: read_nvidia_smi(gpus))
        sampler = cls(read, interval_s=interval_s)
        sampler._thread.start()
        return sampler

    def sample_once(self) -> None:
        try:
            metrics = as_metrics(self._read())
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            log.warning("cannot read GPU utilisation (%s): sampling stops", error)
            self._stop.set()
            return
        with self._lock:
            self._latest = metrics or None

    def take(self) -> dict[str, float] | None:
        """The newest sample not handed out yet, or None."""
        with self._lock:
            latest, self._latest = self._latest, None
        return latest

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample_once()
            self._stop.wait(self.interval_s)

    def close(self) -> None:
        self._stop.set()
