"""Entrypoints that fail or wait on purpose, for tests of failure handling, cancel and timeouts.

One fault cannot be an entrypoint: a rank that never reaches the rendezvous, because every rank joins
the process group before the entrypoint is called. The job asks for it in its env instead:
`STALL_BEFORE_RENDEZVOUS="<rank>:<seconds>"` makes that rank sleep while this module is imported,
which the worker does before the rendezvous (it resolves the entrypoint first). It stands for a rank
stuck in its imports or set-up: a hung file system, a slow node, a deadlocked initialiser.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from worker.context import JobContext
from worker.distributed import guess_rank

log = logging.getLogger(__name__)

STALL_ENV = "STALL_BEFORE_RENDEZVOUS"


def stall_before_rendezvous(setting: str | None = None) -> float:
    """Sleep here if STALL_BEFORE_RENDEZVOUS names this rank; returns the seconds slept."""
    setting = os.environ.get(STALL_ENV, "") if setting is None else setting
    if not setting:
        return 0.0
    rank, _, seconds = setting.partition(":")
    if int(rank) != guess_rank(os.environ):
        return 0.0
    log.warning("stalling %s s before the rendezvous on purpose (%s)", seconds, STALL_ENV)
    started = time.monotonic()
    time.sleep(float(seconds))
    return time.monotonic() - started


def raise_on_rank(ctx: JobContext, rank: int = 1, message: str = "deliberate failure") -> dict[str, Any]:
    """Rank `rank` raises RuntimeError(message) after the group is up; the others wait in a barrier,
    which must fail promptly (not hang) when the failing rank goes away."""
    ctx.barrier()  # everyone connected: the failure happens mid-job, not at rendezvous
    if ctx.rank == rank:
        raise RuntimeError(f"{message} (rank {rank})")
    ctx.barrier()
    return {"ok": True, "world_size": ctx.world_size}


def exit_on_rank(ctx: JobContext, rank: int = 1, code: int = 3) -> dict[str, Any]:
    """Rank `rank` ends its process with os._exit(code): no traceback, no cleanup, like a crash."""
    ctx.barrier()
    if ctx.rank == rank:
        log.error("exiting with status %d on purpose", code)
        logging.shutdown()
        os._exit(code)
    ctx.barrier()
    return {"ok": True, "world_size": ctx.world_size}


def sleep(ctx: JobContext, seconds: float = 60.0) -> dict[str, Any]:
    """Sleep in short naps (signals are handled promptly), reporting progress once a second."""
    started = time.monotonic()
    total = max(1, int(seconds))
    tick = 0
    while (elapsed := time.monotonic() - started) < seconds:
        if elapsed >= tick:
            ctx.report(tick, total=total, elapsed_s=elapsed)
            tick += 1
        time.sleep(min(0.1, max(0.0, seconds - elapsed)))
    ctx.barrier()
    return {"ok": True, "slept_s": time.monotonic() - started}


def hostnames(ctx: JobContext) -> dict[str, Any]:
    """Every rank's socket.gethostname(), in rank order: proof of where a multi-node job ran."""
    names = ctx.all_gather_object(socket.gethostname())
    return {"ok": True, "world_size": ctx.world_size, "hostnames": names, "distinct_hosts": len(set(names))}


stall_before_rendezvous()  # at import: see the module's docstring
