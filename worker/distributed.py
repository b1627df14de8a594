"""Where this rank sits in the job, which port rank 0 listens on, and the process group's life.

This module is the ONLY reader of the scheduler's rank variables (SLURM_*, SUBMITIT_*, MASTER_*,
RANK ...): everything else receives a RankEnv. Deriving one is a pure function of an environment
mapping, so every source can be unit-tested without a cluster. torch is imported lazily, inside the
two functions that need it, so the launcher can derive the rank before paying for torch.
"""

from __future__ import annotations

import logging
import socket
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, replace

from worker.hostlist import expand_hostlist

log = logging.getLogger(__name__)

# Rendezvous ports are 20000 + (job id mod 10000): the last four digits of the job id, easy to read
# in a log. The range stays below Linux's ephemeral range (32768-60999 by default), so an outgoing
# connection of some other program never holds our port. See master_port() for what is guaranteed.
MASTER_PORT_BASE = 20000
MASTER_PORT_SPAN = 10000

LOCAL_MASTER_ADDR = "127.0.0.1"

# The variables a torchrun-style script reads; spec.env must not override them.
RANK_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT")


class PortInUseError(RuntimeError):
    """Rank 0 cannot listen on the job's rendezvous port."""


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in the job. `gpu` is the CUDA index as this process sees it, or None for CPU."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str  # "torchrun" | "slurm" | "local" | "single": where the numbers came from
    job_id: str
    gpu: int | None = None
    visible_gpus: tuple[str, ...] = ()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str:
        """The device this rank should use if CUDA is there: `cuda:<gpu>` or `cpu`."""
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"

    def torchrun_vars(self) -> dict[str, str]:
        """The variables torchrun gives its workers, for scripts that call init_process_group("env://")."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def rank_source(environ: Mapping[str, str]) -> str:
    """Which launcher set this environment up. Priority: torchrun > SLURM > submitit local > single.

    One exception to the order: submitit's local executor marks its tasks SUBMITIT_EXECUTOR=local, and
    SLURM_* variables seen there were inherited from an allocation the service itself runs in, so they
    describe someone else's job and must not win.
    """
    if all(name in environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return "torchrun"
    local = "SUBMITIT_LOCAL_GLOBALID" in environ
    slurm = "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ
    if slurm and not (local and environ.get("SUBMITIT_EXECUTOR") == "local"):
        return "slurm"
    return "local" if local else "single"


def scheduler_job_id(environ: Mapping[str, str], *, fallback: int | str) -> str:
    """The scheduler's id of this job (SLURM job id, or the local controller's PID), else `fallback`."""
    source = rank_source(environ)
    if source == "slurm" and environ.get("SLURM_JOB_ID"):
        return environ["SLURM_JOB_ID"]
    if source == "local" and environ.get("SUBMITIT_LOCAL_JOB_ID"):
        return environ["SUBMITIT_LOCAL_JOB_ID"]
    return str(fallback)


def master_port(job_id: int | str) -> int:
    """The rendezvous port of a job: 20000 + (job id mod 10000), the same on every rank, no talking.

    What this guarantees: two jobs get the same port only if their ids are congruent mod 10000, so any
    jobs whose ids lie within 10000 consecutive numbers never collide.
    - SLURM job ids are handed out in sequence by one controller; two jobs on a node at the same time
      collide only if one is still running after 9999 later submissions (or the ids wrapped at
      MaxJobId). Requeue keeps the id and hence the port; the previous run is dead by then.
    - Local submitit: the id is the controller's PID. PIDs alive at the same time are unique, but they
      range up to pid_max (32768 by default, 4194304 on many distributions), more than 10000 ports, so
      two live controllers whose PIDs differ by a multiple of 10000 do share a port. That is rare (the
      kernel hands PIDs out in sequence too), and rank 0 checks the port before it listens
      (ensure_master_port_free) so it fails with a clear message instead of hanging.
    Non-numeric ids (e.g. submitit's `<array>_<task>`) are hashed with crc32: deterministic, not dense.
    """
    text = str(job_id)
    number = int(text) if text.isdigit() else zlib.crc32(text.encode())
    return MASTER_PORT_BASE + number % MASTER_PORT_SPAN


def derive_rank_env(environ: Mapping[str, str], *, job_id: int | str, gpus_per_node: int) -> RankEnv:
    """This rank's RankEnv from the scheduler's variables (see rank_source for which source wins)."""
    source = rank_source(environ)
    if source == "torchrun":
        env = _from_torchrun(environ, str(job_id))
    elif source == "slurm":
        env = _from_slurm(environ, str(job_id))
    elif source == "local":
        env = _from_submitit_local(environ, str(job_id))
    else:
        env = RankEnv(0, 1, 0, 1, 0, LOCAL_MASTER_ADDR, master_port(job_id), "single", str(job_id))
    _validate(env)
    gpu, visible = bind_gpu(environ, local_rank=env.local_rank, local_world_size=env.local_world_size,
                            gpus_per_node=gpus_per_node)
    return replace(env, gpu=gpu, visible_gpus=visible)


def guess_rank(environ: Mapping[str, str]) -> int:
    """A best-effort global rank for naming an error file when the environment cannot be parsed."""
    for name in ("RANK", "SLURM_PROCID", "SUBMITIT_LOCAL_GLOBALID"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def _from_torchrun(environ: Mapping[str, str], job_id: str) -> RankEnv:
    rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
    # torchrun always sets LOCAL_*; a hand-made env without them is taken to be one node.
    local_world_size = int(environ.get("LOCAL_WORLD_SIZE", world_size))
    local_rank = int(environ.get("LOCAL_RANK", rank % local_world_size))
    node_rank = int(environ.get("GROUP_RANK", rank // local_world_size))
    return RankEnv(rank, world_size, local_rank, local_world_size, node_rank, environ["MASTER_ADDR"],
                   int(environ["MASTER_PORT"]), "torchrun", job_id)


def _from_slurm(environ: Mapping[str, str], job_id: str) -> RankEnv:
    rank, world_size = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
    node_rank = int(environ.get("SLURM_NODEID", "0"))
    nodelist = (environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
                or environ.get("SLURM_NODELIST") or "")
    hosts = expand_hostlist(nodelist) if nodelist else []
    num_nodes = len(hosts) or int(environ.get("SLURM_JOB_NUM_NODES", environ.get("SLURM_NNODES", "1")))
    local_world_size = _slurm_local_world_size(environ, node_rank, world_size, num_nodes)
    local_rank = int(environ.get("SLURM_LOCALID", rank % local_world_size))
    # Block distribution (SLURM's default, and what submitit asks for) puts rank 0 on the first host.
    master_addr = hosts[0] if hosts else LOCAL_MASTER_ADDR
    return RankEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr,
                   master_port(job_id), "slurm", job_id)


def _slurm_local_world_size(environ: Mapping[str, str], node_rank: int, world_size: int,
                            num_nodes: int) -> int:
    """Tasks on this node: the step's actual distribution first (`2(x3),1`), then what was asked for."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"):
        value = environ.get(name)
        if value:
            counts = expand_tasks_per_node(value)
            return counts[node_rank] if node_rank < len(counts) else counts[-1]
    return max(1, world_size // max(1, num_nodes))


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed task counts, one per node: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        count, _, repeat = part.partition("(x")
        counts.extend([int(count)] * (int(repeat.rstrip(")")) if repeat else 1))
    return counts


def _from_submitit_local(environ: Mapping[str, str], job_id: str) -> RankEnv:
    rank = int(environ["SUBMITIT_LOCAL_GLOBALID"])
    world_size = int(environ.get("SUBMITIT_LOCAL_NTASKS", "1"))
    local_rank = int(environ.get("SUBMITIT_LOCAL_LOCALID", rank))
    # The local executor runs one node only: every rank is local and rank 0 listens on loopback.
    return RankEnv(rank, world_size, local_rank, world_size, 0, LOCAL_MASTER_ADDR, master_port(job_id),
                   "local", job_id)


def _validate(env: RankEnv) -> None:
    if not 0 <= env.rank < env.world_size:
        raise ValueError(f"rank {env.rank} outside world size {env.world_size} ({env.source})")
    if not 0 <= env.local_rank < env.local_world_size:
        raise ValueError(f"local rank {env.local_rank} outside {env.local_world_size} ({env.source})")


def bind_gpu(environ: Mapping[str, str], *, local_rank: int, local_world_size: int,
             gpus_per_node: int) -> tuple[int | None, tuple[str, ...]]:
    """The CUDA index this rank should use (as the process sees devices) and the GPUs it can see.

    - CUDA_VISIBLE_DEVICES set (SLURM and submitit set it): indices are positions in that list.
      If the rank sees the node's GPUs (--gpus-per-node: every task sees all), it takes the one at its
      local rank; if it sees only its own (--gpus-per-task, --gpu-bind), it takes the first of them.
    - Only SLURM_STEP_GPUS / SLURM_JOB_GPUS set: nothing was renumbered, indices are physical ids.
    - Neither: every GPU is visible; assume the node's first `gpus_per_node`.
    More ranks than GPUs share them round-robin (fine for gloo; NCCL refuses two ranks on one GPU).
    """
    if gpus_per_node <= 0:
        return None, ()
    renumbered = True
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        visible = _split_ids(cvd)
    elif environ.get("SLURM_STEP_GPUS") or environ.get("SLURM_JOB_GPUS"):
        visible = _split_ids(environ.get("SLURM_STEP_GPUS") or environ.get("SLURM_JOB_GPUS", ""))
        renumbered = False
    else:
        visible = tuple(str(index) for index in range(gpus_per_node))
    if not visible or visible == ("-1",):
        return None, ()
    if len(visible) >= local_world_size:
        slot = local_rank
    elif len(visible) * local_world_size <= gpus_per_node:
        slot = 0  # a per-task view: these GPUs are this rank's alone
    else:
        slot = local_rank % len(visible)
    return (slot if renumbered else int(visible[slot])), visible


def _split_ids(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def choose_backend(cuda_available: bool, gpus: int) -> str:
    """NCCL when this rank has a GPU and CUDA works; gloo otherwise (CPU jobs, or a GPU-less node)."""
    return "nccl" if cuda_available and gpus > 0 else "gloo"


def ensure_master_port_free(env: RankEnv) -> None:
    """On rank 0, fail at once with a clear message if the rendezvous port is taken.

    Without this, a taken port shows up as a rendezvous timeout minutes later. Under torchrun the
    agent already listens on MASTER_PORT by design, so there is nothing to check.
    """
    if not env.is_main or env.source == "torchrun":
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # TCPStore sets SO_REUSEADDR too: a port in TIME_WAIT from a requeued run is not "taken".
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", env.master_port))
        except OSError as error:
            raise PortInUseError(
                f"rendezvous port {env.master_port} on {socket.gethostname()} is already in use ({error}); "
                f"it is derived from job id {env.job_id} as {MASTER_PORT_BASE} + id mod {MASTER_PORT_SPAN}: "
                f"another job whose id is congruent, or another program, holds it"
            ) from error


def init_process_group(env: RankEnv, *, timeout_s: float) -> str:
    """Join the job's default process group; returns the backend. The timeout bounds every collective.

    A bounded timeout is what keeps a rank from waiting forever for a peer that died before it
    connected; a peer that dies after connecting closes its sockets, and gloo fails at once.
    """
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    backend = choose_backend(torch.cuda.is_available(), 0 if env.gpu is None else 1)
    device_id = None
    if backend == "nccl":
        assert env.gpu is not None
        torch.cuda.set_device(env.gpu)
        device_id = torch.device("cuda", env.gpu)
    # torchrun's agent hosts the store at MASTER_PORT: join it through env://. Otherwise rank 0 hosts it.
    init_method = "env://" if env.source == "torchrun" else f"tcp://{env.master_addr}:{env.master_port}"
    log.info("joining process group: backend=%s %s world_size=%d timeout=%.0fs", backend, init_method,
             env.world_size, timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return backend


def teardown() -> None:
    """Destroy the default process group if there is one; never raises (it runs on the way out)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        dist.destroy_process_group()
    except Exception:  # a broken group cannot be destroyed cleanly; the process is exiting anyway
        log.warning("destroy_process_group failed", exc_info=True)
