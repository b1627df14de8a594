"""Rank environments from SLURM, submitit-local and torchrun variables; restart counts; backend choice."""

from __future__ import annotations

from dataclasses import replace

import pytest

from worker.distributed import (
    UNSET_PORT,
    bind_gpu,
    choose_backend,
    derive_rank_env,
    expand_tasks_per_node,
    rank_source,
    scheduler_job_id,
)
from worker.hostlist import expand_hostlist

# ------------------------------------------------------------------ hostlists


@pytest.mark.parametrize(
    ("expression", "hosts"),
    [
        ("n1", ["n1"]),
        ("n[01-03,07]", ["n01", "n02", "n03", "n07"]),
        ("gpu-[1-2],cpu5", ["gpu-1", "gpu-2", "cpu5"]),
        ("a[1-2]b", ["a1b", "a2b"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("node[8-11]", ["node8", "node9", "node10", "node11"]),
        ("x[098-101]", ["x098", "x099", "x100", "x101"]),
        ("a,b[3],c[1-2]-ib", ["a", "b3", "c1-ib", "c2-ib"]),
    ],
)
def test_expand_hostlist(expression: str, hosts: list[str]) -> None:
    assert expand_hostlist(expression) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[a-b]", "n[3-1]", "n[[1]]"])
def test_expand_hostlist_rejects_malformed(bad: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(bad)


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3)") == [2, 2, 2]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]


# ------------------------------------------------------------------ sources

SLURM = {
    "SLURM_JOB_ID": "123457",
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_TASKS_PER_NODE": "2(x4)",
    "SLURM_JOB_NODELIST": "n[01-03,07]",
    "SUBMITIT_EXECUTOR": "slurm",
}


def test_slurm_rank_env() -> None:
    env = derive_rank_env(SLURM, job_id=scheduler_job_id(SLURM, fallback=9), gpus_per_node=0)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (5, 8, 1, 2, 2)
    assert env.master_addr == "n01" and env.source == "slurm" and env.job_id == "123457"
    assert env.master_port == UNSET_PORT, "the rendezvous chooses the port, not the job id"
    assert env.restart == 0
    assert env.gpu is None and env.device == "cpu"


def test_slurm_uneven_tasks_per_node_uses_this_nodes_count() -> None:
    environ = {**SLURM, "SLURM_NTASKS": "7", "SLURM_PROCID": "6", "SLURM_NODEID": "3", "SLURM_LOCALID": "0",
               "SLURM_STEP_TASKS_PER_NODE": "2(x3),1"}
    env = derive_rank_env(environ, job_id=1, gpus_per_node=0)
    assert env.local_world_size == 1 and env.node_rank == 3


def test_slurm_step_nodelist_wins_over_job_nodelist() -> None:
    env = derive_rank_env({**SLURM, "SLURM_STEP_NODELIST": "n[02-03]"}, job_id=1, gpus_per_node=0)
    assert env.master_addr == "n02"


def test_submitit_local_rank_env() -> None:
    environ = {"SUBMITIT_LOCAL_GLOBALID": "2", "SUBMITIT_LOCAL_LOCALID": "2", "SUBMITIT_LOCAL_NTASKS": "4",
               "SUBMITIT_LOCAL_JOB_ID": "31337", "SUBMITIT_EXECUTOR": "local"}
    job_id = scheduler_job_id(environ, fallback=7)
    env = derive_rank_env(environ, job_id=job_id, gpus_per_node=0)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (2, 4, 2, 4, 0)
    assert env.master_addr == "127.0.0.1" and env.master_port == UNSET_PORT and env.source == "local"


def test_restart_is_slurms_restart_count_on_slurm_and_the_launchers_requeues_elsewhere() -> None:
    # On SLURM every requeue bumps SLURM_RESTART_COUNT, whoever asked; the launcher's count is ignored.
    assert derive_rank_env({**SLURM, "SLURM_RESTART_COUNT": "2"}, job_id=1, gpus_per_node=0,
                           requeues=5).restart == 2
    assert derive_rank_env(SLURM, job_id=1, gpus_per_node=0, requeues=5).restart == 0
    local = {"SUBMITIT_LOCAL_GLOBALID": "0", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_EXECUTOR": "local",
             "SLURM_RESTART_COUNT": "7"}  # inherited from the allocation the service runs in
    assert derive_rank_env(local, job_id=1, gpus_per_node=0, requeues=3).restart == 3
    assert derive_rank_env({}, job_id=1, gpus_per_node=0, requeues=1).restart == 1


def test_local_executor_inside_a_slurm_allocation_ignores_the_inherited_slurm_vars() -> None:
    environ = {**SLURM, "SUBMITIT_EXECUTOR": "local", "SUBMITIT_LOCAL_GLOBALID": "1",
               "SUBMITIT_LOCAL_LOCALID": "1", "SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "4242"}
    assert rank_source(environ) == "local"
    assert scheduler_job_id(environ, fallback=0) == "4242"
    env = derive_rank_env(environ, job_id="4242", gpus_per_node=0)
    assert (env.rank, env.world_size, env.master_addr) == (1, 2, "127.0.0.1")


def test_torchrun_env_is_respected_over_slurm() -> None:
    environ = {**SLURM, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "1", "MASTER_ADDR": "head", "MASTER_PORT": "29500"}
    env = derive_rank_env(environ, job_id=1, gpus_per_node=0)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.node_rank) == (3, 4, 1, 2, 1)
    assert (env.master_addr, env.master_port, env.source) == ("head", 29500, "torchrun")


def test_partial_torchrun_vars_do_not_count() -> None:
    # A lone MASTER_PORT inherited from the submitting shell must not pin every job to one port.
    environ = {**SLURM, "MASTER_PORT": "29500", "MASTER_ADDR": "elsewhere"}
    env = derive_rank_env(environ, job_id=123457, gpus_per_node=0)
    assert env.source == "slurm" and env.master_port == UNSET_PORT and env.master_addr == "n01"


def test_single_process_without_a_scheduler() -> None:
    env = derive_rank_env({}, job_id=77, gpus_per_node=0)
    assert (env.rank, env.world_size, env.source, env.master_port) == (0, 1, "single", UNSET_PORT)
    assert scheduler_job_id({}, fallback=77) == "77"


def test_inconsistent_numbers_are_refused() -> None:
    with pytest.raises(ValueError, match="outside world size"):
        derive_rank_env({**SLURM, "SLURM_PROCID": "8"}, job_id=1, gpus_per_node=0)


def test_torchrun_vars_roundtrip() -> None:
    env = replace(derive_rank_env(SLURM, job_id=123457, gpus_per_node=0), master_port=41234)
    again = derive_rank_env(env.torchrun_vars(), job_id=0, gpus_per_node=0)
    assert (again.rank, again.world_size, again.local_rank, again.node_rank, again.master_port) == (
        env.rank, env.world_size, env.local_rank, env.node_rank, 41234)


def test_torchrun_vars_refuse_a_port_the_rendezvous_has_not_chosen() -> None:
    with pytest.raises(ValueError, match="rendezvous first"):
        derive_rank_env(SLURM, job_id=1, gpus_per_node=0).torchrun_vars()


# ------------------------------------------------------------------ GPUs


@pytest.mark.parametrize(
    ("environ", "local_rank", "local_world_size", "gpus_per_node", "expected"),
    [
        ({}, 1, 2, 0, None),  # a CPU job
        ({"CUDA_VISIBLE_DEVICES": ""}, 0, 1, 2, None),  # asked for GPUs, sees none
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, 3, 4, 4, 3),  # --gpus-per-node: every task sees all
        ({"CUDA_VISIBLE_DEVICES": "2"}, 3, 4, 4, 0),  # --gpus-per-task=1: its own, renumbered
        ({"CUDA_VISIBLE_DEVICES": "4,5"}, 1, 4, 8, 0),  # --gpus-per-task=2: the first of its own
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 3, 4, 2, 1),  # more ranks than GPUs: round-robin
        ({"SLURM_STEP_GPUS": "4,5,6,7"}, 2, 4, 4, 6),  # not renumbered: physical ids
        ({}, 1, 2, 2, 1),  # nothing says: the node's first GPUs
    ],
)
def test_bind_gpu(environ: dict[str, str], local_rank: int, local_world_size: int, gpus_per_node: int,
                  expected: int | None) -> None:
    gpu, _ = bind_gpu(environ, local_rank=local_rank, local_world_size=local_world_size,
                      gpus_per_node=gpus_per_node)
    assert gpu == expected


def test_slurm_rank_gets_its_gpu() -> None:
    env = derive_rank_env({**SLURM, "CUDA_VISIBLE_DEVICES": "0,1"}, job_id=1, gpus_per_node=2)
    assert env.gpu == 1 and env.device == "cuda:1" and env.visible_gpus == ("0", "1")


@pytest.mark.parametrize(("cuda", "gpus", "backend"), [(True, 1, "nccl"), (True, 0, "gloo"),
                                                       (False, 1, "gloo"), (False, 0, "gloo")])
def test_choose_backend(cuda: bool, gpus: int, backend: str) -> None:
    assert choose_backend(cuda, gpus) == backend
