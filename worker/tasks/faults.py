"""Entrypoints that fail or wait on purpose, for tests of failure handling, cancel and timeouts."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from worker.context import JobContext

log = logging.getLogger(__name__)


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
