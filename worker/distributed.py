"""Where this rank sits in the job, and the process group's life.

This module is the ONLY reader of the scheduler's rank variables (SLURM_*, SUBMITIT_*, MASTER_*,
RANK ...): everything else receives a RankEnv. Deriving one is a pure function of an environment
mapping, so every source can be unit-tested without a cluster. torch is imported lazily, inside the
two functions that need it, so the launcher can derive the rank before paying for torch.

The rendezvous port is not derived here: rank 0 gets one from the kernel and tells the other ranks
through the job folder (worker.rendezvous). Until then RankEnv.master_port is 0 (UNSET_PORT), except
under torchrun, whose MASTER_PORT is respected as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from worker.hostlist import expand_hostlist

if TYPE_CHECKING:  # torch.distributed re-exports it without telling mypy
    from torch._C._distributed_c10d import Store

log = logging.getLogger(__name__)

UNSET_PORT = 0  # RankEnv.master_port before the rendezvous has chosen the port

LOCAL_MASTER_ADDR = "127.0.0.1"

# Set by the job's supervisor (worker.supervisor) on every rank it starts:
RUN_ENV = "TORCHYARD_RUN"  # which run of the ranks in this allocation: 0, then 1 after a restart in place
REQUEUES_ENV = "TORCHYARD_REQUEUES"  # how often submitit handed the supervisor back (local requeues)

# The variables a torchrun-style script reads; spec.env must not override them.
RANK_ENV_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT")


@dataclass(frozen=True)
class RankEnv:
    """One rank's place in the job. `gpu` is the CUDA index as this process sees it, or None for CPU."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int  # UNSET_PORT until the rendezvous (worker.rendezvous) chose it; torchrun's as given
    source: str  # "torchrun" | "slurm" | "local" | "single": where the numbers came from
    job_id: str
    gpu: int | None = None
    visible_gpus: tuple[str, ...] = ()
    restart: int = 0  # SLURM_RESTART_COUNT, or how often submitit's local controller requeued the job
    run: int = 0  # restarts in place before this run of the ranks (RUN_ENV)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> str:
        """The device this rank should use if CUDA is there: `cuda:<gpu>` or `cpu`."""
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"

    def torchrun_vars(self) -> dict[str, str]:
        """The variables torchrun gives its workers, for scripts that call init_process_group("env://")."""
        if self.master_port == UNSET_PORT:
            raise ValueError("MASTER_PORT is not chosen yet: run the rendezvous first")
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


def derive_rank_env(environ: Mapping[str, str], *, job_id: int | str, gpus_per_node: int,
                    requeues: int | None = None) -> RankEnv:
    """This rank's RankEnv from the scheduler's variables (see rank_source for which source wins).

    `requeues`: how many times the launcher was handed back through checkpoint() (default: the
    supervisor's REQUEUES_ENV); it is the restart count everywhere but on SLURM, where
    SLURM_RESTART_COUNT counts every requeue (whoever asked). RUN_ENV numbers the runs in place.
    """
    if requeues is None:
        requeues = _count(environ.get(REQUEUES_ENV))
    source = rank_source(environ)
    if source == "torchrun":
        env = _from_torchrun(environ, str(job_id))
    elif source == "slurm":
        env = _from_slurm(environ, str(job_id))
    elif source == "local":
        env = _from_submitit_local(environ, str(job_id))
    else:
        env = RankEnv(0, 1, 0, 1, 0, LOCAL_MASTER_ADDR, UNSET_PORT, "single", str(job_id))
    restart = int(environ.get("SLURM_RESTART_COUNT") or 0) if source == "slurm" else requeues
    env = replace(env, restart=restart, run=_count(environ.get(RUN_ENV)))
    _validate(env)
    gpu, visible = bind_gpu(environ, local_rank=env.local_rank, local_world_size=env.local_world_size,
                            gpus_per_node=gpus_per_node)
    return replace(env, gpu=gpu, visible_gpus=visible)


def _count(value: str | None) -> int:
    return int(value) if value is not None and value.isascii() and value.isdigit() else 0


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
    return RankEnv(rank, world_size, local_rank, local_world_size, node_rank, master_addr, UNSET_PORT,
                   "slurm", job_id)


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
    return RankEnv(rank, world_size, local_rank, world_size, 0, LOCAL_MASTER_ADDR, UNSET_PORT, "local",
                   job_id)


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


def init_process_group(env: RankEnv, *, timeout_s: float, store: Store | None) -> str:
    """Join the job's default process group; returns the backend. The timeout bounds every collective.

    `store` is the rendezvous store (worker.rendezvous.rendezvous_store): hosted by rank 0, joined by
    the others. None only under torchrun, whose agent hosts the store at MASTER_PORT (env://).

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
    if store is None and env.source != "torchrun":
        raise ValueError(f"a {env.source} rank needs the rendezvous store to join the process group")
    log.info("joining process group: backend=%s master=%s:%d world_size=%d timeout=%.0fs", backend,
             env.master_addr, env.master_port, env.world_size, timeout_s)
    timeout = timedelta(seconds=timeout_s)
    if store is None:
        dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size,
                                timeout=timeout, device_id=device_id)
    else:
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, device_id=device_id)
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
