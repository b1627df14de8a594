"""Entrypoints that stall on purpose, for the watchdog's tests (service.loops.watch): one rank stuck in
this module while the others wait in a collective, every rank deadlocked, and a healthy job whose
steps are slow."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from worker.context import JobContext

log = logging.getLogger(__name__)


def sleep_forever() -> None:
    """Where the stuck rank stays: a data loader that never returns, say."""
    while True:
        time.sleep(3600)


def hang_on_rank(ctx: JobContext, rank: int = 1, steps: int = 4, step_s: float = 0.5) -> dict[str, Any]:
    """`steps` steps (an all_reduce and a report each `step_s`), then rank `rank` sleeps forever in
    sleep_forever while the others wait for it in the next all_reduce."""
    total = torch.zeros(1)
    for step in range(steps):
        total += _step(ctx, step_s)
        ctx.report(step, loss=float(total.item()))
    if ctx.rank == rank:
        sleep_forever()
    dist.all_reduce(total)  # waits for the stuck rank
    return {"ok": False}


def deadlock(ctx: JobContext, steps: int = 2) -> dict[str, Any]:
    """A few steps, then every rank waits to receive from the next one, and none sends."""
    for step in range(steps):
        _step(ctx, 0.2)
        ctx.report(step)
    box = torch.zeros(1)
    dist.recv(box, src=(ctx.rank + 1) % ctx.world_size)
    return {"ok": False}


def slow_steps(ctx: JobContext, steps: int = 3, step_s: float = 20.0) -> dict[str, Any]:
    """Healthy, slow: each step computes for `step_s` (many small pieces of work), then all-reduces
    and reports."""
    total = torch.zeros(1)
    for step in range(steps):
        total += _work(step_s)
        dist.all_reduce(total)
        ctx.report(step, total=steps, value=float(total.item()))
    return {"ok": True, "steps": steps}


def _step(ctx: JobContext, step_s: float) -> torch.Tensor:
    value = torch.ones(1) * (ctx.rank + 1)
    dist.all_reduce(value)
    time.sleep(step_s)
    return value


def _work(seconds: float) -> torch.Tensor:
    """Compute for `seconds`: matrix products in a Python loop (what the rank runs keeps changing)."""
    generator = torch.Generator().manual_seed(0)
    matrix = torch.randn(64, 64, generator=generator) / 8
    vector = torch.randn(64, generator=generator)
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        vector = _mix(matrix, vector)
    return vector.sum().reshape(1) * 0


def _mix(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    return torch.tanh(matrix @ vector)
