"""The rendezvous: rank 0 takes a port the kernel hands out, and the job folder tells the other ranks.

Why not a port derived from the job id: any map from job ids onto a range of ports sends two live jobs
to the same port sooner or later (local controller PIDs 10000 apart, SLURM ids 10000 apart on a node).
A port rank 0 got by binding port 0 is, on the kernel's word, held by no other socket on that node, and
while rank 0 listens on it nobody else can bind it.

The protocol, for every source but torchrun (whose agent already listens on MASTER_PORT):
1. rank 0 gets a port. Function mode: its c10d TCPStore listens on port 0 and keeps what it got, so no
   other job can ever hold the same port at the same time. Script mode: it binds port 0, reads the port
   and closes it; the script's own init_process_group listens on it later (see free_port's window).
2. rank 0 publishes {"addr", "port", "host", "pid"} atomically (temp file, fsync, rename) as
   `<job folder>/rendezvous/<key>.json` (JobFiles.rendezvous), key from rendezvous_key().
3. every other rank polls for that file every POLL_S, up to the rendezvous timeout, then connects.
4. a rank whose rendezvous fails (or whose process group cannot form) raises, writes its error file
   and exits; the job's supervisor (worker.supervisor) then stops every other rank of the run, one
   stuck before the rendezvous too, and restarts the run in place or ends the attempt. A rank does
   not stop its peers itself: the supervisor watches them all (locally they are its children or its
   warm parent's, on SLURM one srun step of it).

The folder is shared on SLURM (the job folder is) and the same disk locally. The key changes with every
run of the ranks, so a retried or requeued job never reads the port of a run before it.

What is guaranteed:
- function mode: no two jobs on one node can hold the same MASTER_PORT at the same time. The port is
  the one the kernel bound rank 0's store to (every interface), and the store holds it until the
  process group is gone;
- script mode: the port was free on rank 0's node when rank 0 picked it; free_port says what the gap
  before the script listens leaves open;
- torchrun: MASTER_ADDR and MASTER_PORT are torchrun's, untouched.

Importing this module is torch-free; torch is imported inside the two functions that build stores.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from worker.distributed import RankEnv
from worker.files import atomic_write_text

if TYPE_CHECKING:  # torch.distributed re-exports it without telling mypy
    from torch._C._distributed_c10d import TCPStore

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a waiting rank looks for rank 0's file


class RendezvousError(RuntimeError):
    """The ranks could not agree on rank 0's address and port."""


@dataclass(frozen=True)
class Endpoint:
    """Where rank 0's rendezvous store listens (or, in script mode, will listen)."""

    addr: str
    port: int


def rendezvous_key(env: RankEnv, attempt: int) -> str:
    """`<scheduler job id>-a<attempt>-r<restart>[-p<run>]`: the same on every rank, new for every run of
    the ranks.

    - the scheduler's job id: the SLURM job id (array tasks `<array>_<task>`), or the local controller's
      PID, unique among live processes; either stays the same through a requeue;
    - attempt: the service's attempt number, new for every retry in the same job folder;
    - restart (RankEnv.restart): SLURM_RESTART_COUNT, which every requeue bumps whoever asked for it;
      locally the number of times Supervisor.checkpoint() handed the job back (REQUEUES_ENV), the
      only way submitit's local controller restarts its task;
    - run (RankEnv.run): the restarts in place before this run (worker.supervisor), when there were any.
    What is left: a later local controller that is handed a dead one's PID AND runs the same attempt of
    the same job in the same folder, which the service does not do.
    """
    job = re.sub(r"[^A-Za-z0-9_.\-]", "_", env.job_id) or "job"
    run = f"-p{env.run}" if env.run else ""
    return f"{job}-a{attempt}-r{env.restart}{run}"


def publish(path: Path, endpoint: Endpoint) -> None:
    """Rank 0: write the endpoint to `path` atomically (a reader sees no file, or the whole file)."""
    record = {"addr": endpoint.addr, "port": endpoint.port, "host": socket.gethostname(), "pid": os.getpid()}
    atomic_write_text(path, json.dumps(record) + "\n")
    log.info("rendezvous published: %s:%d in %s", endpoint.addr, endpoint.port, path)


def read_endpoint(path: Path) -> Endpoint | None:
    """The endpoint in `path`, None while there is no such file; RendezvousError if it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        addr, port = data["addr"], data["port"]
    except (ValueError, TypeError, KeyError) as error:
        raise RendezvousError(f"{path} is not a rendezvous file ({error!r}): {text[:200]!r}") from error
    if not (isinstance(addr, str) and addr and isinstance(port, int) and 0 < port < 65536):
        raise RendezvousError(f"{path} holds no usable address and port: {text[:200]!r}")
    return Endpoint(addr, port)


def wait_for_endpoint(path: Path, *, timeout_s: float, poll_s: float = POLL_S) -> Endpoint:
    """Poll for rank 0's file every `poll_s` until it appears; RendezvousError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (endpoint := read_endpoint(path)) is None:
        if time.monotonic() >= deadline:
            raise RendezvousError(
                f"rank 0 did not publish its rendezvous port in {path} within {timeout_s:g}s: it did not "
                f"start, failed before the rendezvous (see its error file and log), or runs another attempt")
        time.sleep(poll_s)
    return endpoint


def free_port() -> int:
    """A port no socket on this host holds right now: bind port 0 on every interface, read it, close it.

    Script mode only, where the script's own init_process_group must bind MASTER_PORT itself. The
    wildcard is what c10d's TCPStore binds (`::`, dual-stack, else 0.0.0.0), so the port is free for it.
    The window: between this close and the script's init_process_group (its imports and set-up before
    it), another process on the node could bind the same port, and the script would then fail with
    "address already in use" (clearly, not a hang). That needs a process to pick that exact port in
    that window: the kernel starts its search for port 0 at a random place in the ephemeral range
    (~28000 ports), so it is a chance in tens of thousands per concurrent start, where a port derived
    from the job id collided every time for ids congruent mod 10000.
    """
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            probe.bind(("::", 0))
            return int(probe.getsockname()[1])
    except OSError:  # no IPv6 on this host
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            return int(probe.getsockname()[1])


def host_store(addr: str, world_size: int, timeout_s: float) -> TCPStore:
    """Rank 0: a c10d TCPStore listening on a port the kernel chooses (store.port says which).

    It listens on every interface (`::` dual-stack, else 0.0.0.0); `addr` is how rank 0 reaches it.
    """
    import torch.distributed as dist

    store: TCPStore = dist.TCPStore(  # type: ignore[attr-defined]
        host_name=addr, port=0, world_size=world_size, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False)
    return store


def join_store(endpoint: Endpoint, world_size: int, *, connect_s: float, timeout_s: float) -> TCPStore:
    """Another rank: a client of rank 0's store; connecting is bounded by `connect_s`, later calls by
    `timeout_s`."""
    import torch.distributed as dist

    store: TCPStore = dist.TCPStore(  # type: ignore[attr-defined]
        host_name=endpoint.addr, port=endpoint.port, world_size=world_size, is_master=False,
        timeout=timedelta(seconds=max(connect_s, 1.0)))
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def rendezvous_store(env: RankEnv, path: Path, *, timeout_s: float) -> tuple[RankEnv, TCPStore | None]:
    """Function mode: the store every rank passes to init_process_group, and `env` with the real port.

    Rank 0 hosts the store on a kernel-chosen port and publishes it in `path`; the other ranks wait for
    `path` (up to `timeout_s`) and connect. Under torchrun there is nothing to do: (env, None), and
    init_process_group joins the agent's store through env://.
    """
    if env.source == "torchrun":
        return env, None
    if env.is_main:
        store = host_store(env.master_addr, env.world_size, timeout_s)
        endpoint = Endpoint(env.master_addr, int(store.port))
        publish(path, endpoint)
    else:
        deadline = time.monotonic() + timeout_s
        endpoint = wait_for_endpoint(path, timeout_s=timeout_s)
        store = join_store(endpoint, env.world_size, connect_s=deadline - time.monotonic(),
                           timeout_s=timeout_s)
    return replace(env, master_addr=endpoint.addr, master_port=endpoint.port), store


def rendezvous_port(env: RankEnv, path: Path, *, timeout_s: float) -> RankEnv:
    """Script mode: `env` with the port the script's rank 0 will listen on (rank 0 picks it, see
    free_port, and publishes it in `path`; the others wait for it). Under torchrun: `env` as it is."""
    if env.source == "torchrun":
        return env
    if env.is_main:
        endpoint = Endpoint(env.master_addr, free_port())
        publish(path, endpoint)
    else:
        endpoint = wait_for_endpoint(path, timeout_s=timeout_s)
    return replace(env, master_addr=endpoint.addr, master_port=endpoint.port)
