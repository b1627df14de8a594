"""The two founding demonstrations, as entrypoints that check their own claims.

Each returns {"ok": bool, ...evidence} on every rank (rank 0 decides and broadcasts), so a test or
a user reads one dict instead of comparing printed tensors by eye. Tensors compute on ctx.device
(NCCL runs on the GPU) and travel to CPU before they are gathered as objects.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from worker.context import JobContext


def ddp_parameters(ctx: JobContext, seed: int = 0, lr: float = 0.01) -> dict[str, Any]:
    """DDP makes every replica start from rank 0's parameters and stay equal after an SGD step, which
    equals ONE process applying SGD with the average of the ranks' gradients. Meant for 3 ranks (any >= 2).
    """
    torch.manual_seed(seed + ctx.rank)  # a different start per rank, so equality is DDP's doing
    model = nn.Linear(5, 5).to(ctx.device)
    before_wrap = _flat_params(model)
    ddp = DistributedDataParallel(model, device_ids=ctx.device_ids)  # broadcasts rank 0's parameters
    initial = {name: value.detach().cpu().clone() for name, value in model.state_dict().items()}

    generator = torch.Generator().manual_seed(seed + 1000 + ctx.rank)  # each rank its own batch
    inputs, targets = torch.randn(4, 5, generator=generator), torch.randn(4, 5, generator=generator)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
    loss = nn.functional.mse_loss(ddp(inputs.to(ctx.device)), targets.to(ctx.device))
    loss.backward()  # type: ignore[no-untyped-call]  # DDP all-reduces (averages) the gradients here
    optimizer.step()

    befores = ctx.all_gather_object(before_wrap)
    initials = ctx.all_gather_object(torch.cat([value.flatten() for value in initial.values()]))
    afters = ctx.all_gather_object(_flat_params(model))
    batches = ctx.all_gather_object((inputs, targets, float(loss.item())))
    result: dict[str, Any] | None = None
    if ctx.is_main:
        expected = _averaged_gradient_step(initial, [(x, y) for x, y, _ in batches], lr)
        result = _ddp_verdict(ctx.world_size, befores, initials, afters, expected)
        result["loss_per_rank"] = [item[2] for item in batches]
        result["backend"] = ctx.backend
    verdict: dict[str, Any] = ctx.broadcast_object(result)
    return verdict


def _averaged_gradient_step(initial: dict[str, torch.Tensor],
                            batches: list[tuple[torch.Tensor, torch.Tensor]], lr: float) -> torch.Tensor:
    """What one process computes: each rank's gradient on a copy of the start, averaged, one SGD step."""
    reference = nn.Linear(5, 5)
    reference.load_state_dict(initial)
    gradients: list[list[torch.Tensor]] = []
    for inputs, targets in batches:
        reference.zero_grad()
        nn.functional.mse_loss(reference(inputs), targets).backward()  # type: ignore[no-untyped-call]
        gradients.append([param.grad.detach().clone() for param in reference.parameters()
                          if param.grad is not None])
    average = [torch.stack(per_param).mean(dim=0) for per_param in zip(*gradients, strict=True)]
    with torch.no_grad():
        stepped = [param - lr * grad for param, grad in zip(reference.parameters(), average, strict=True)]
    return torch.cat([value.flatten() for value in stepped])


def _ddp_verdict(world_size: int, befores: list[torch.Tensor], initials: list[torch.Tensor],
                 afters: list[torch.Tensor], expected: torch.Tensor) -> dict[str, Any]:
    differed = any(not torch.equal(befores[0], other) for other in befores[1:])
    initial_match = all(torch.equal(befores[0], other) for other in initials)
    identical = all(torch.equal(afters[0], other) for other in afters[1:])
    matches = bool(torch.allclose(afters[0], expected, rtol=1e-5, atol=1e-6))
    return {
        "ok": initial_match and identical and matches and (differed or world_size == 1),
        "world_size": world_size,
        "initial_params_differed_before_ddp": differed,
        "initial_params_match_rank0": initial_match,
        "params_identical_after_step": identical,
        "matches_averaged_gradient_step": matches,
        "max_abs_diff": float((afters[0] - expected).abs().max()),
    }


def sampler_shards(ctx: JobContext, num_samples: int = 8, batch_size: int = 1,
                   seed: int = 0) -> dict[str, Any]:
    """DistributedSampler(shuffle=False) gives rank r the samples r, r+W, r+2W ... of ONE dataset that
    every rank builds alike (the seed's first version drew a different dataset per rank). Meant for 4 ranks.
    """
    # The same generator seed on every rank: one dataset, which the checksum below proves.
    features = torch.randn(num_samples, 3, generator=torch.Generator().manual_seed(seed))
    dataset = TensorDataset(torch.arange(num_samples), features)
    checksum = hashlib.sha256(features.numpy().tobytes()).hexdigest()
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, num_replicas=ctx.world_size, rank=ctx.rank,
                                                          shuffle=False)
    seen: list[int] = []
    rows_match = True
    for indices, rows in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
        rows = rows.to(ctx.device)
        rows_match &= bool(torch.equal(rows.cpu(), features[indices]))  # the sample is that row's data
        seen.extend(int(index) for index in indices.tolist())

    shards = ctx.all_gather_object(seen)
    checksums = ctx.all_gather_object(checksum)
    rows_ok = ctx.all_gather_object(rows_match)
    result: dict[str, Any] | None = None
    if ctx.is_main:
        result = _sampler_verdict(num_samples, shards, checksums, all(rows_ok))
    verdict: dict[str, Any] = ctx.broadcast_object(result)
    return verdict


def expected_shard(num_samples: int, world_size: int, rank: int) -> list[int]:
    """DistributedSampler's rule without shuffling: pad by repeating the start, then take every W-th."""
    total = -(-num_samples // world_size) * world_size
    indices = list(range(num_samples))
    indices += indices[: total - num_samples]
    return indices[rank:total:world_size]


def _sampler_verdict(num_samples: int, shards: list[list[int]], checksums: list[str],
                     rows_ok: bool) -> dict[str, Any]:
    world_size = len(shards)
    expected = [expected_shard(num_samples, world_size, rank) for rank in range(world_size)]
    every = [index for shard in shards for index in shard]
    disjoint = len(every) == len(set(every))
    covers = set(every) == set(range(num_samples))
    identical = len(set(checksums)) == 1
    as_expected = shards == expected
    return {
        # With padding (num_samples not a multiple of W) the sampler repeats samples: not disjoint.
        "ok": as_expected and covers and identical and rows_ok and (disjoint or num_samples % world_size > 0),
        "world_size": world_size,
        "num_samples": num_samples,
        "shards": {str(rank): shard for rank, shard in enumerate(shards)},
        "each_rank_got_expected_shard": as_expected,
        "shards_disjoint": disjoint,
        "shards_cover_dataset": covers,
        "dataset_identical_on_all_ranks": identical,
        "dataset_checksum": checksums[0],
        "samples_match_dataset_rows": rows_ok,
    }


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([param.detach().flatten() for param in model.parameters()]).cpu()

