"""A torchrun-style script that reports nothing to torchyard: a few all_reduces, then rank 1 sleeps
forever in stuck_here while the other ranks wait for it in the next all_reduce."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def stuck_here() -> None:
    while True:
        time.sleep(3600)


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    value = torch.ones(1)
    for _ in range(3):
        dist.all_reduce(value)
    if dist.get_rank() == 1:
        stuck_here()
    dist.all_reduce(value)


if __name__ == "__main__":
    main()
