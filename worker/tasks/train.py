"""A small, real DDP training run: progress every few steps, a checkpoint every epoch, exact resume.

Checkpoints are named by the global step at the end of their epoch (so a checkpoint line's "step"
is comparable with the progress lines' "step"); the epoch is kept inside the checkpoint.

Regression of a fixed random linear map plus a tanh bend, on a synthetic dataset that every rank
builds alike from `seed`. Nothing random happens after setup except the sampler's shuffle, which
DistributedSampler derives from (seed, epoch); so restarting at an epoch boundary from the saved
model and optimizer (momentum buffers included) continues bit for bit, and param_checksum of an
interrupted-and-resumed run equals that of an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from worker.context import JobContext

log = logging.getLogger(__name__)

FEATURES = 8


def train(ctx: JobContext, epochs: int = 5, samples: int = 512, batch_size: int = 32, lr: float = 0.05,
          seed: int = 0, report_every: int = 5, sleep_per_step: float = 0.0,
          fail_on_attempts: Sequence[int] = (), width: int = 16, depth: int = 1,
          hang_on_attempts: Sequence[int] = ()) -> dict[str, Any]:
    """Train for `epochs` (resuming after the last checkpointed epoch); checked result on every rank.

    `fail_on_attempts`: raise on every rank right after this attempt's first checkpoint, as a job
    that breaks mid-run does (what retry policies are tested with). `hang_on_attempts`: there, rank 1
    sleeps forever instead (in hang_forever) while the others wait for it in the next epoch's
    all_reduce: a hang, for the watchdog's `on_stall: "fail"`. `width` and `depth`: the hidden
    layers (bench.train makes the step dominate with a bigger model). The result's `timing` says
    where this attempt's epochs spent their time: all of it, report() and checkpointing."""
    dataset = make_dataset(samples, seed)
    torch.manual_seed(seed)  # the same start on every rank (DDP would broadcast rank 0's anyway)
    model = make_model(width, depth).to(ctx.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    start_epoch, step, first_loss, resumed_from = 0, 0, None, None
    state = ctx.load_checkpoint()
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        resumed_from, step, first_loss = int(state["epoch"]), int(state["step"]), float(state["first_loss"])
        start_epoch = resumed_from + 1
        log.info("resuming after epoch %d (step %d)", resumed_from, step)
    if first_loss is None:
        first_loss = evaluate(model, dataset, ctx.device)

    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    total = epochs * len(loader)
    final_loss = first_loss
    timing = Timing()
    began, first_step = time.perf_counter(), step
    for epoch in range(start_epoch, epochs):
        sampler.set_epoch(epoch)  # a new, agreed shuffle every epoch
        # A new DDP wrapper every epoch: DDP lays its gradient buckets out anew after its first step, and
        # with 3 or more ranks the order gloo sums a bucket's chunks in follows that layout. A run
        # resumed at an epoch boundary starts a fresh wrapper there; so does an uninterrupted one, and
        # the two stay equal bit for bit (2 ranks are, either way: a + b == b + a).
        ddp = DistributedDataParallel(model, device_ids=ctx.device_ids)
        step = _train_epoch(ctx, ddp, optimizer, loader, epoch, step, total, report_every, sleep_per_step,
                            timing)
        del ddp  # its reducer's hooks go with it, before the next epoch's wrapper adds its own
        final_loss = evaluate(model, dataset, ctx.device)
        with timing.measure("report_s"):
            ctx.report(step, total=total, loss=final_loss, epoch=epoch)
        with timing.measure("checkpoint_s"):
            ctx.save_checkpoint({"model": _cpu(model.state_dict()), "optimizer": optimizer.state_dict(),
                                 "epoch": epoch, "step": step, "first_loss": first_loss}, step)
        if ctx.attempt in fail_on_attempts:
            raise RuntimeError(f"failing on purpose after epoch {epoch}'s checkpoint (attempt {ctx.attempt})")
        if ctx.attempt in hang_on_attempts and ctx.rank == min(1, ctx.world_size - 1):
            hang_forever()
    if start_epoch >= epochs:  # nothing left to train: the loss of the checkpointed model
        final_loss = evaluate(model, dataset, ctx.device)
    return {
        "ok": final_loss < first_loss,
        "first_loss": first_loss,
        "final_loss": final_loss,
        "epochs_run": max(0, epochs - start_epoch),
        "resumed_from_epoch": resumed_from,
        "steps": step,
        "world_size": ctx.world_size,
        "param_checksum": param_checksum(model),
        "timing": {"epochs_s": time.perf_counter() - began, "steps": step - first_step,
                   "samples": (step - first_step) * batch_size * ctx.world_size, **timing.seconds},
    }


def hang_forever() -> None:
    """Where hang_on_attempts leaves rank 1 (a data loader that never returns, say)."""
    log.warning("hanging on purpose")
    while True:
        time.sleep(3600)


class Timing:
    """Seconds spent per kind of work, summed (rank 0's report() and checkpoints, for bench.train)."""

    def __init__(self) -> None:
        self.seconds = {"report_s": 0.0, "checkpoint_s": 0.0}

    @contextmanager
    def measure(self, kind: str) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - began


def _train_epoch(ctx: JobContext, ddp: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader[Any],
                 epoch: int, step: int, total: int, report_every: int, sleep_per_step: float,
                 timing: Timing) -> int:
    for inputs, targets in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(inputs.to(ctx.device)), targets.to(ctx.device))
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        step += 1
        if report_every > 0 and step % report_every == 0:
            value = float(loss.item())
            with timing.measure("report_s"):
                ctx.report(step, total=total, loss=value, epoch=epoch)
        if sleep_per_step > 0:
            time.sleep(sleep_per_step)  # lets tests watch, cancel or preempt a run mid-epoch
    return step


def make_dataset(samples: int, seed: int) -> TensorDataset:
    """The same `samples` (x, y) pairs on every rank: y = tanh(x W) v + a little noise."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, FEATURES, generator=generator)
    hidden = torch.randn(FEATURES, 4, generator=generator)
    out = torch.randn(4, 1, generator=generator)
    targets = torch.tanh(inputs @ hidden) @ out + 0.05 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(inputs, targets)


def make_model(width: int = 16, depth: int = 1) -> nn.Module:
    """`depth` hidden layers of `width` (the default is the small model every test trains)."""
    layers: list[nn.Module] = [nn.Linear(FEATURES, width), nn.Tanh()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 1))


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset, device: torch.device) -> float:
    """Mean squared error on the whole dataset (the same number on every rank)."""
    inputs, targets = dataset.tensors
    return float(nn.functional.mse_loss(model(inputs.to(device)), targets.to(device)).item())


def param_checksum(model: nn.Module) -> str:
    """sha256 of the parameters' bytes: equal only if every parameter is equal bit for bit."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(param.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def _cpu(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().cpu() for name, value in state.items()}
