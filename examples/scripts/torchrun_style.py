"""A plain torchrun-style script, as users write them: torchyard runs it unchanged in script mode.

    torchrun --nproc-per-node 2 examples/scripts/torchrun_style.py --out sum.json

It reads only what torchrun provides (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT through
init_method="env://"), all-reduces one number per rank, and rank 0 writes the sum as JSON to --out, a
file name in the job's own folder (TORCHYARD_JOB_DIR under torchyard, else the working directory):
a script any user may run must not write wherever its account can.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist


def file_name(value: str) -> str:
    """A plain file name: no folder, no way out of the job's folder."""
    if not value or "/" in value or value in (".", ".."):
        raise argparse.ArgumentTypeError(f"must be a file name without '/', not {value!r}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=file_name, help="the JSON report's file name")
    parser.add_argument("--value", type=float, default=1.0, help="rank r contributes value * (r + 1)")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    dist.init_process_group("nccl" if use_cuda else "gloo", init_method="env://")
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    contribution = torch.tensor([args.value * (rank + 1)], device=device)
    dist.all_reduce(contribution)  # sum over ranks
    if rank == 0:
        report = {
            "world_size": world_size,
            "sum": contribution.item(),
            "expected": args.value * world_size * (world_size + 1) / 2,
            "backend": dist.get_backend(),
            "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        }
        path = os.path.join(os.environ.get("TORCHYARD_JOB_DIR", "."), args.out)
        # O_NOFOLLOW: a link left in the folder cannot turn the report into a write elsewhere.
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(report, handle)
        print(f"rank 0 of {world_size}: sum {report['sum']} written to {path}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
