"""A job script the stacks tests submit (script mode, as a torchrun-style script runs): rank 1 sleeps for
ever in `stuck` while every other rank waits for it in all_reduce. The tests read `stuck`'s line from
this file.

    hang_rank.py [--hostile] [--regex]

--regex: rank 1 is stuck in C code that holds the GIL instead (a catastrophic regex, in
`stuck_in_regex`): its Python thread never runs again, and its stack must come all the same.
--hostile: rank 0 also keeps growing its stacks file (sparse gigabytes, then binary bytes), as a
job may: the service must read it bounded and say so.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import torch
import torch.distributed as dist

STUCK_RANK = 1


def stuck() -> None:
    while True:
        time.sleep(3600)  # the stuck line


def stuck_in_regex() -> None:
    re.match(r"(a+)+$", "a" * 64 + "b")  # the regex line: 2**64 steps, the GIL held throughout


def flood(path: str) -> None:
    while True:
        if os.path.exists(path):
            with open(path, "ab") as handle:
                handle.truncate(os.path.getsize(path) + 2**30)
                handle.write(bytes(range(256)) * 16 + b"\x00\xed\xa0\x80")
        time.sleep(0.05)


def main() -> None:
    dist.init_process_group("gloo", init_method="env://")
    rank = dist.get_rank()
    if "--hostile" in sys.argv and rank == 0:
        path = os.path.join(os.environ["TORCHYARD_JOB_DIR"], "stacks", "rank0.txt")
        threading.Thread(target=flood, args=(path,), daemon=True).start()
    if rank == STUCK_RANK:
        stuck_in_regex() if "--regex" in sys.argv else stuck()
    total = torch.ones(1)
    dist.all_reduce(total)  # waits for the stuck rank


if __name__ == "__main__":
    main()
