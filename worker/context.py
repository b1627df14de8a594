"""JobContext: what a function entrypoint receives as its first argument, on every rank.

It carries the rank's place in the job and the device, and the only ways a task talks to the
service: progress lines (report), checkpoints (save_checkpoint) and the return value. A torchrun-style
script, which is handed nothing, asks for the same with `current()`:

    from worker.context import current

    ctx = current()             # after init_process_group, which the script calls itself
    ctx.report(step, total=steps, loss=loss.item())
    ctx.save_checkpoint(state, epoch)   # into TORCHYARD_CHECKPOINT_DIR

(`TORCHYARD_JOB_DIR` and `TORCHYARD_CHECKPOINT_DIR` are in every rank's environment too, for code
that does not import the worker.)
Rank 0 alone writes files; on the other ranks the writing methods do nothing, so a task may call
them unconditionally.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from worker.checkpoints import CheckpointWriter, remove_unfinished
from worker.distributed import RankEnv
from worker.files import ProgressWriter
from worker.gpu_stats import GpuSampler
from worker.spec import (
    MAX_METRIC_NAMES,
    MAX_METRICS_PER_LINE,
    RunSpec,
    UpstreamJob,
    metrics_problem,
)

log = logging.getLogger(__name__)


class JobContext:
    """One rank's view of the job attempt it runs in."""

    def __init__(self, spec: RunSpec, env: RankEnv, *, backend: str = "gloo",
                 progress_interval_s: float = 0.5) -> None:
        self.rank = env.rank
        self.world_size = env.world_size
        self.local_rank = env.local_rank
        self.local_world_size = env.local_world_size
        self.node_rank = env.node_rank
        # Where rank 0's store listens: the port the rendezvous got from the kernel (or torchrun's).
        self.master_addr = env.master_addr
        self.master_port = env.master_port
        self.is_main = env.is_main
        self.backend = backend
        self.device = torch.device(env.device if backend == "nccl" else "cpu")
        self.job_id = spec.job_id  # the service's id; the scheduler's is scheduler_job_id
        self.scheduler_job_id = env.job_id
        self.attempt = spec.attempt
        self.run_id = spec.run_name  # the same over retries and requeues: an experiment tracker's run
        self.upstream = list(spec.upstream)  # the jobs this one ran after, in the order `after` named them
        self.files = spec.files
        self.folder = self.files.folder
        self.checkpoint_dir = self.files.checkpoints
        if self.is_main:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_policy = spec.checkpoints
        # Read once, at start, so every rank resumes from the same file even while rank 0 saves new ones.
        # The ledger's word first; when the policy has deleted that one since, the newest there is.
        recorded = Path(spec.resume_from) if spec.resume_from else None
        self.resume_from: Path | None = (recorded if recorded is not None and recorded.is_file()
                                         else self.files.latest_checkpoint())
        self._progress = ProgressWriter(self.files.progress, interval_s=progress_interval_s)
        self._checkpoints = CheckpointWriter(self.files, self._progress, self.checkpoint_policy, self.attempt)
        if self.is_main:
            remove_unfinished(self.files)  # what a rank 0 killed mid-write left: no other writes now
        self._last_metrics: dict[str, float | None] = {}  # rank 0's latest reported value of each metric
        self._metric_names: set[str] = set()  # every name rank 0 has reported, up to MAX_METRIC_NAMES
        self._told_of_names = False
        # Rank 0 of a GPU job: the GPUs of its node (the job's), sampled in the background.
        self._gpus = GpuSampler.for_gpus(env.visible_gpus) if self.is_main and backend == "nccl" else None

    def upstream_of(self, name: str) -> UpstreamJob:
        """The job this one ran after whose pipeline stage (or, failing that, name) is `name`."""
        for one in self.upstream:
            if one.stage == name:
                return one
        for one in self.upstream:
            if one.name == name:
                return one
        known = ", ".join(one.stage or one.name for one in self.upstream) or "none"
        raise KeyError(f"this job ran after no job or stage named {name!r} (it ran after: {known})")

    @property
    def device_ids(self) -> list[int] | None:
        """What DistributedDataParallel wants as device_ids: [this GPU] under NCCL, None on CPU."""
        return [self.device.index or 0] if self.device.type == "cuda" else None

    def report(self, step: int, total: int | None = None, **metrics: float) -> None:
        """Rank 0: queue a progress line {"step","total","metrics","time","attempt"}; others: nothing.

        Cheap enough for every step: no disk access here, a background thread appends the queued
        lines at most every 0.5 s, and close() writes the rest. Non-finite metrics are written as null.
        On a GPU job the newest GPU sample (worker.gpu_stats), when there is one, joins the metrics
        while the line has room.

        What the service would not record is said here, on every rank alike: more than
        MAX_METRICS_PER_LINE metrics, or a name longer than MAX_METRIC_NAME_CHARS, is a ValueError; a
        new name once the job has reported MAX_METRIC_NAMES is dropped, and the log says so once.
        """
        if (problem := metrics_problem(metrics)) is not None:
            raise ValueError(problem)
        if not self.is_main:
            return
        values = self._named_within_limit({n: _finite_or_none(float(v)) for n, v in metrics.items()})
        self._last_metrics.update(values)
        if self._gpus is not None and (sample := self._gpus.take()):
            room = MAX_METRICS_PER_LINE - len(values)
            values.update(self._named_within_limit(dict(itertools.islice(sample.items(), room))))
        self._progress.append({"step": int(step), "total": None if total is None else int(total),
                               "metrics": values, "time": time.time(), "attempt": self.attempt})

    def _named_within_limit(self, values: dict[str, float | None]) -> dict[str, float | None]:
        """`values` less the new names past the job's first MAX_METRIC_NAMES: the service drops them."""
        new = [name for name in values if name not in self._metric_names]
        room = max(MAX_METRIC_NAMES - len(self._metric_names), 0)
        self._metric_names.update(new[:room])
        if len(new) <= room:
            return values
        if not self._told_of_names:
            self._told_of_names = True
            log.warning("a job records at most %d metric names: '%s' and any other new name from now on "
                        "is dropped", MAX_METRIC_NAMES, new[room])  # fmt: skip
        return {name: value for name, value in values.items() if name in self._metric_names}

    def save_checkpoint(self, state: dict[str, Any], epoch_or_step: int, *, wait: bool = False) -> Path:
        """Rank 0: copy `state` in memory and write it to checkpoints/ckpt-<n>.pt in the background.

        Training is held only for the copy: tensors detached and copied to CPU (into buffers kept from
        the previous save), containers rebuilt, other values deep-copied. A background thread then
        writes the file (temp, fsync, rename), the note beside it (ckpt-<n>.json: the metrics last
        reported, which `keep_best` compares), the progress line {"checkpoint", "step", "time",
        "attempt"}, and lets the job's checkpoint policy delete what it does not keep (never this
        one). Only once its note is written is a checkpoint listed or resumed from, so a rank killed
        mid-write leaves none that a restart would load (worker.checkpoints).

        The path returned names the file it will be: whole once the write ends. `wait=True` returns
        only then; so does the next save, which first waits for the one before (at most one copy in
        memory besides the live state), and close(), which the launcher calls before it writes the
        result. A write that failed is raised (CheckpointWriteError) by the next save or by close().
        Other ranks save nothing and get the same path back.
        """
        if not self.is_main:
            return self.files.checkpoint_file(epoch_or_step).resolve()
        return self._checkpoints.save(state, epoch_or_step, self._last_metrics, wait=wait)

    def load_checkpoint(self, *, weights_only: bool = True) -> dict[str, Any] | None:
        """The state saved at resume_from (on CPU), or None when this attempt starts from scratch."""
        if self.resume_from is None:
            return None
        log.info("loading checkpoint %s", self.resume_from)
        state: dict[str, Any] = torch.load(self.resume_from, map_location="cpu", weights_only=weights_only)
        return state

    def barrier(self) -> None:
        """Wait for every rank (bounded by the process group's timeout)."""
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index or 0])
        else:
            dist.barrier()

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank (pickled; move tensors to CPU first)."""
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s `obj` on every rank (the others' argument is ignored)."""
        if not (dist.is_available() and dist.is_initialized()) or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def close(self) -> None:
        """Wait for the checkpoint being written and write the progress lines still queued (the
        launcher calls this on the way out, before the result). Raises CheckpointWriteError when that
        checkpoint could not be written (once: a second close does not)."""
        if self._gpus is not None:
            self._gpus.close()
        try:
            self._checkpoints.wait()
        finally:
            self._progress.close()

    def __repr__(self) -> str:
        return (f"JobContext(job_id={self.job_id}, attempt={self.attempt}, "
                f"rank={self.rank}/{self.world_size}, local_rank={self.local_rank}, "
                f"node_rank={self.node_rank}, device={self.device})")


_current: JobContext | Callable[[], JobContext] | None = None  # the rank's, or how to make it


def current() -> JobContext:
    """The JobContext of the rank this runs in: a function entrypoint's own, or for a script one made
    at the first call (after its init_process_group, so that it knows the backend)."""
    global _current
    if _current is None:
        raise RuntimeError("worker.context.current() answers only inside a torchyard job's rank")
    if not isinstance(_current, JobContext):
        _current = _current()
    return _current


def set_current(context: JobContext | Callable[[], JobContext] | None) -> None:
    """The runner's: what current() answers for the entrypoint about to run (None: nothing)."""
    global _current
    _current = context


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
