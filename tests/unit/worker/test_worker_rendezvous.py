"""The rendezvous in one process: file names per run, publishing, waiting, kernel-chosen ports, stores."""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from worker.distributed import UNSET_PORT, RankEnv, derive_rank_env, init_process_group
from worker.rendezvous import (
    Endpoint,
    RendezvousError,
    free_port,
    publish,
    read_endpoint,
    rendezvous_key,
    rendezvous_port,
    rendezvous_store,
    wait_for_endpoint,
)
from worker.spec import JobFiles

LOCAL = {"SUBMITIT_LOCAL_NTASKS": "2", "SUBMITIT_LOCAL_JOB_ID": "31337", "SUBMITIT_EXECUTOR": "local"}


def local_env(rank: int, *, job_id: str = "31337", requeues: int = 0) -> RankEnv:
    environ = {**LOCAL, "SUBMITIT_LOCAL_GLOBALID": str(rank), "SUBMITIT_LOCAL_JOB_ID": job_id}
    return derive_rank_env(environ, job_id=job_id, gpus_per_node=0, requeues=requeues)


# ------------------------------------------------------------------ names


def test_the_key_is_the_same_on_every_rank_and_new_for_every_run() -> None:
    assert rendezvous_key(local_env(0), 1) == rendezvous_key(local_env(1), 1) == "31337-a1-r0"
    keys = {rendezvous_key(local_env(0), 1), rendezvous_key(local_env(0), 2),  # a retry
            rendezvous_key(local_env(0, requeues=1), 1),  # a local requeue
            rendezvous_key(local_env(0, job_id="41337"), 1)}  # another job
    assert len(keys) == 4
    slurm = {"SLURM_JOB_ID": "77_3", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_RESTART_COUNT": "2"}
    env = derive_rank_env(slurm, job_id="77_3", gpus_per_node=0)
    assert rendezvous_key(env, 1) == "77_3-a1-r2"
    assert rendezvous_key(replace(env, job_id="../x y"), 1) == ".._x_y-a1-r2"  # stays one file name


def test_the_file_lives_in_the_job_folders_rendezvous_dir(tmp_path: Path) -> None:
    assert JobFiles(tmp_path).rendezvous("31337-a1-r0") == tmp_path / "rendezvous" / "31337-a1-r0.json"


# ------------------------------------------------------------------ publish and read


def test_publish_writes_one_whole_json_file(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous" / "k.json"
    assert read_endpoint(path) is None
    publish(path, Endpoint("127.0.0.1", 41234))
    data = json.loads(path.read_text())
    assert data["addr"] == "127.0.0.1" and data["port"] == 41234 and data["host"] == socket.gethostname()
    assert read_endpoint(path) == Endpoint("127.0.0.1", 41234)
    assert [p.name for p in path.parent.iterdir()] == ["k.json"], "no temp file left behind"


@pytest.mark.parametrize("text", ["", "{not json", "[1, 2]", '{"addr": "h"}', '{"addr": "h", "port": 0}',
                                  '{"addr": "", "port": 5}', '{"addr": "h", "port": "5"}'])
def test_a_file_that_is_not_a_rendezvous_fails_naming_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(RendezvousError, match=r"bad\.json"):
        read_endpoint(path)


# ------------------------------------------------------------------ waiting


def test_waiting_times_out_with_the_files_name(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous" / "31337-a1-r0.json"
    started = time.monotonic()
    with pytest.raises(RendezvousError, match=r"31337-a1-r0\.json within 0\.2s"):
        wait_for_endpoint(path, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - started < 2


def test_waiting_returns_soon_after_rank0_publishes(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous" / "k.json"
    published: list[float] = []

    def rank0() -> None:
        time.sleep(0.2)
        publish(path, Endpoint("127.0.0.1", 40001))
        published.append(time.monotonic())

    thread = threading.Thread(target=rank0)
    thread.start()
    endpoint = wait_for_endpoint(path, timeout_s=10)
    thread.join()
    assert endpoint == Endpoint("127.0.0.1", 40001)
    assert time.monotonic() - published[0] < 1.0  # polled, not slept through


def test_a_stale_file_of_another_attempt_or_requeue_is_never_read(tmp_path: Path) -> None:
    files = JobFiles(tmp_path)
    publish(files.rendezvous(rendezvous_key(local_env(0), 1)), Endpoint("127.0.0.1", 40001))  # attempt 1
    publish(files.rendezvous(rendezvous_key(local_env(0), 2)), Endpoint("127.0.0.1", 40002))  # its retry
    requeued = local_env(1, requeues=1)  # attempt 2, after a requeue: rank 0 has not published yet
    with pytest.raises(RendezvousError, match="31337-a2-r1"):
        rendezvous_port(requeued, files.rendezvous(rendezvous_key(requeued, 2)), timeout_s=0.2)


# ------------------------------------------------------------------ ports and stores


def test_free_port_is_bindable_on_every_interface() -> None:
    port = free_port()
    assert 0 < port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("", port))


def test_script_mode_every_rank_gets_rank0s_port(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous" / "k.json"
    got: list[RankEnv] = []
    thread = threading.Thread(target=lambda: got.append(rendezvous_port(local_env(1), path, timeout_s=10)))
    thread.start()  # rank 1 waits first
    rank0 = rendezvous_port(local_env(0), path, timeout_s=10)
    thread.join()
    assert rank0.master_port != UNSET_PORT and got[0].master_port == rank0.master_port
    assert rank0.torchrun_vars()["MASTER_PORT"] == str(rank0.master_port)


def test_function_mode_ranks_share_one_store_on_a_kernel_chosen_port(tmp_path: Path) -> None:
    path = tmp_path / "rendezvous" / "k.json"
    got: list[object] = []

    def rank1() -> None:
        env, store = rendezvous_store(local_env(1), path, timeout_s=20)
        assert store is not None
        got.extend([env, store.get("from-rank0")])

    thread = threading.Thread(target=rank1)
    thread.start()
    env0, store0 = rendezvous_store(local_env(0), path, timeout_s=20)
    assert store0 is not None
    store0.set("from-rank0", "hello")
    thread.join(timeout=30)
    assert env0.master_port == int(store0.port) == read_endpoint(path).port  # type: ignore[union-attr]
    assert got[0] == replace(local_env(1), master_port=env0.master_port) and got[1] == b"hello"


def test_jobs_whose_old_ports_collided_get_different_ones(tmp_path: Path) -> None:
    # Under 20000 + id mod 10000, local jobs 5 and 10005 both had port 20005.
    stores = []
    for job_id in ("5", "10005"):
        env = local_env(0, job_id=job_id)
        path = JobFiles(tmp_path / job_id).rendezvous(rendezvous_key(env, 1))
        env, store = rendezvous_store(env, path, timeout_s=5)
        stores.append((env.master_port, store))
    assert stores[0][0] != stores[1][0], "both stores listen at once: the kernel cannot give one port twice"


def test_a_rank_waits_for_rank0_at_most_the_timeout(tmp_path: Path) -> None:
    with pytest.raises(RendezvousError, match=r"k\.json within 0\.3s"):
        rendezvous_store(local_env(1), tmp_path / "k.json", timeout_s=0.3)


def test_torchrun_is_left_as_it_is(tmp_path: Path) -> None:
    env = derive_rank_env({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "head", "MASTER_PORT": "29500"},
                          job_id=1, gpus_per_node=0)
    assert rendezvous_store(env, tmp_path / "k.json", timeout_s=0.1) == (env, None)
    assert rendezvous_port(env, tmp_path / "k.json", timeout_s=0.1) == env
    assert not (tmp_path / "k.json").exists()


def test_only_torchrun_may_join_without_a_store() -> None:
    with pytest.raises(ValueError, match="needs the rendezvous store"):
        init_process_group(local_env(0), timeout_s=1, store=None)
