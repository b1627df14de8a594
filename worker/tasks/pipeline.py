"""Three small stages of a pipeline (examples/pipeline.yaml): `prepare` writes a dataset, `train` trains
on it (worker.tasks.train, which checkpoints every epoch on rank 0), `evaluate` loads the checkpoint
train left, found through ctx.upstream, and measures it. CPU only, a few seconds each.

Each stage reads what the one before left through ctx.upstream_of(stage): its result (prepare's
dataset path) and its newest checkpoint (train's), so the three are a real hand-over, not three jobs
that happen to run in order.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import TensorDataset

from worker.context import JobContext
from worker.tasks import train as training

log = logging.getLogger(__name__)

DATASET = "dataset.pt"


def prepare(ctx: JobContext, samples: int = 256, seed: int = 0) -> dict[str, Any]:
    """Rank 0 writes the dataset (inputs and targets) into the job's folder; its path and size."""
    path = ctx.folder / DATASET
    if ctx.is_main:
        inputs, targets = training.make_dataset(samples, seed).tensors
        torch.save({"inputs": inputs, "targets": targets, "seed": seed}, path)
    ctx.barrier()
    return {"path": str(path), "bytes": path.stat().st_size, "samples": samples, "seed": seed}


def train(ctx: JobContext, fail_while: str | None = None, **kwargs: Any) -> dict[str, Any]:
    """worker.tasks.train on the dataset prepare made (its size and seed; the file is checked to be
    there and whole). `fail_while`: a path; while a file is there, fail on purpose (a stage that
    breaks, which a test then fixes by removing the file and `retry --from train`)."""
    if fail_while is not None and Path(fail_while).exists():
        raise RuntimeError(f"failing on purpose: {fail_while} exists")
    prepared = ctx.upstream_of("prepare").result
    dataset = _load(Path(prepared["path"]))
    samples = len(dataset)
    result = training.train(ctx, samples=samples, seed=int(prepared["seed"]), **kwargs)
    return {**result, "dataset": prepared["path"], "samples": samples}


def evaluate(ctx: JobContext, samples: int = 128, seed: int = 1) -> dict[str, Any]:
    """The model of train's newest checkpoint, measured on held-out samples (another seed)."""
    upstream = ctx.upstream_of("train")
    if upstream.checkpoint is None:
        raise RuntimeError(f"job {upstream.job_id} (train) left no checkpoint")
    state = torch.load(upstream.checkpoint, map_location="cpu", weights_only=True)
    model = training.make_model()
    model.load_state_dict(state["model"])
    with torch.no_grad():
        loss = training.evaluate(model, training.make_dataset(samples, seed), torch.device("cpu"))
    trained = upstream.result or {}
    return {"loss": loss, "checkpoint": upstream.checkpoint, "train_job": upstream.job_id,
            "epoch": int(state["epoch"]), "train_loss": trained.get("final_loss")}  # fmt: skip


def _load(path: Path) -> TensorDataset:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    return TensorDataset(saved["inputs"], saved["targets"])
