"""worker.tasks.train's loop as a plain torchrun script: the same data, model, DDP, sampler, optimizer
and per-epoch evaluation, without torchyard (no JobContext, no report(), no checkpoints). Writes its
samples/s to OUT as JSON.

torchrun --standalone --nproc_per_node=3 bench/torchrun_train.py OUT KWARGS_JSON
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from worker.tasks.train import evaluate, make_dataset, make_model


def run(
    epochs: int, samples: int, batch_size: int, lr: float, width: int, depth: int, seed: int = 0
) -> dict[str, Any]:
    dataset = make_dataset(samples, seed)
    torch.manual_seed(seed)
    model = make_model(width, depth)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ddp = DistributedDataParallel(model)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    device = torch.device("cpu")
    began, steps = time.perf_counter(), 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for inputs, targets in loader:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(ddp(inputs), targets)
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
            steps += 1
        evaluate(model, dataset, device)
    elapsed = time.perf_counter() - began
    return {"epochs_s": elapsed, "steps": steps, "samples": steps * batch_size * dist.get_world_size()}


if __name__ == "__main__":
    out, kwargs = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    try:
        timing = run(**kwargs)
        if dist.get_rank() == 0:
            out.write_text(json.dumps(timing))
    finally:
        dist.destroy_process_group()
