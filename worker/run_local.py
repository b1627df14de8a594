"""Runs of the ranks on this machine: the supervisor (under submitit's local controller) starts one
process per rank, `python -m worker.rank_main <spec>`, as submitit's controller started its tasks
(the same SUBMITIT_LOCAL_* variables, the same per-rank log files), and watches them itself.

The ranks stay in the controller's process group, so the local backend's cancel (SIGINT, then
SIGKILL, to the group) and its stacks signal (SIGURG) reach them as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from worker.distributed import REQUEUES_ENV, RUN_ENV
from worker.spec import RunSpec
from worker.supervisor import RunEnd, classify
from worker.warm_ranks import RankProcess, WarmParent

log = logging.getLogger("worker.supervisor")

STOP_GRACE_S = 2.0  # SIGTERM, then SIGKILL this long after: a stopped run leaves nothing to finish
SETTLE_S = 5.0  # a run that ends the attempt: how long its ranks may take to fail by themselves
WARM_START_S = 120.0  # how long the warm parent may take to import torch before ranks start cold


class LocalRuns:
    """Runs on this machine, one process per rank, forked from the job's warm parent when it has one
    (worker.warm_ranks: torch imported once, a restart only forks), started cold when it has none."""

    def __init__(self, spec: RunSpec, *, requeues: int, external_id: str) -> None:
        self.spec = spec
        self.requeues = requeues
        self.external_id = external_id  # the controller's PID: the job's id, and its logs' names
        self.warm: WarmParent | None = None
        self.warm_failed = False

    def hosts(self) -> list[str]:
        return [socket.gethostname()]

    def start(self, spec_path: Path, run: int, hosts: list[str]) -> ProcessRun:
        ranks = self.spec.resources.world_size  # one node
        warm = self.warm_parent(spec_path)
        processes: dict[int, RankProcess] = {}
        for rank in range(ranks):
            env = {
                "SUBMITIT_LOCAL_GLOBALID": str(rank),
                "SUBMITIT_LOCAL_LOCALID": str(rank),
                "SUBMITIT_LOCAL_NTASKS": str(ranks),
                RUN_ENV: str(run),
                REQUEUES_ENV: str(self.requeues),
            }
            out = self.spec.files.rank_log(self.external_id, rank, "out")
            err = self.spec.files.rank_log(self.external_id, rank, "err")
            forked = warm.fork(rank, env, out, err, spec_path) if warm is not None else None
            processes[rank] = forked if forked is not None else start_cold(spec_path, env, out, err)
        log.info("run %d: %d ranks %s (pids %s)", run, ranks, "forked" if warm else "started",
                 [p.pid for p in processes.values()])
        host = hosts[0] if hosts else socket.gethostname()
        return ProcessRun(self.spec, processes, dict.fromkeys(processes, host))

    def warm_parent(self, spec_path: Path) -> WarmParent | None:
        """The job's warm parent, started at the first run; None when it could not import the worker
        (the ranks then start cold, and their error files say why)."""
        if self.warm is None and not self.warm_failed:
            self.warm = WarmParent(warm_parent_command(spec_path))
            self.warm_failed = not self.warm.wait_ready([None], WARM_START_S)
        if self.warm is not None and not self.warm.usable([None]):
            self.warm, self.warm_failed = None, True
        return self.warm


def warm_parent_command(spec_path: Path) -> list[str]:
    return [sys.executable, "-u", "-m", "worker.warm_ranks", str(spec_path)]


def start_cold(spec_path: Path, env: dict[str, str], out_path: Path, err_path: Path) -> RankProcess:
    with open(out_path, "ab") as out, open(err_path, "ab") as err:
        # cwd "/": `-m` puts the working folder first on sys.path, and the job's folder holds what
        # the job wrote; the rank moves to its folder itself (worker.launch.apply_env).
        return subprocess.Popen([sys.executable, "-u", "-m", "worker.rank_main", str(spec_path)],
                                env={**os.environ, **env}, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                cwd="/")


class ProcessRun:
    """One run's rank processes, each watched on its own: this machine's, cold or forked, and on SLURM
    ranks forked by the warm parents on the allocation's nodes (worker.run_slurm). `node_of`: each
    rank's node."""

    def __init__(self, spec: RunSpec, processes: dict[int, RankProcess], node_of: dict[int, str]) -> None:
        self.spec = spec
        self.processes = processes
        self.node_of = node_of

    def ended(self) -> RunEnd | None:
        codes = {rank: process.poll() for rank, process in self.processes.items()}
        if all(code == 0 for code in codes.values()):
            return RunEnd(ok=True)
        failed = {rank: code for rank, code in codes.items() if code is not None and code != 0}
        if not failed:
            return None
        time.sleep(0.05)  # a killed rank's peers fail within milliseconds: see which went first
        codes = {rank: process.poll() for rank, process in self.processes.items()}
        exits = {rank: code for rank, code in codes.items() if code is not None}
        return classify(exits, self.spec.files, self.spec.attempt, self.node_of)

    def settle(self) -> None:
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.processes.values()):
            time.sleep(0.05)
        self.stop()

    def stop(self) -> None:
        alive = [process for process in self.processes.values() if process.poll() is None]
        for process in alive:
            _signal(process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in alive:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(process, signal.SIGKILL)
                process.wait()


def _signal(process: RankProcess, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signum)
