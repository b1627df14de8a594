"""Runs of the ranks in a SLURM allocation: the supervisor (in the batch script, on the batch host)
starts each run as one `srun` job step over the nodes it chose, and a lost node is left out of the next.

The allocation holds `nodes + spare_nodes` nodes and survives a lost node (`--no-kill`, in the batch
script the service writes); a step over N of them runs `python -m worker.rank_main <spec>` in every
task, its output in the per-rank log files the service reads. srun's own words ("task 1: Killed") say
which rank went first; squeue and sinfo (worker.slurm_nodes) say which node is gone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from worker.distributed import REQUEUES_ENV, RUN_ENV
from worker.run_local import WARM_START_S, ProcessRun, warm_parent_command
from worker.slurm_nodes import SRUN_STEP_FLAGS, SlurmQueryError, allocation_hosts, usable_hosts
from worker.spec import RANK_ERROR_ENV, RANK_OUTPUT_ENV, SRUN_ENV, RunSpec
from worker.supervisor import Run, RunEnd, classify
from worker.warm_ranks import RankProcess, WarmParent

log = logging.getLogger("worker.supervisor")

STOP_WAIT_S = 5.0  # after SIGKILL to srun: how long its reader may take to see the pipe close
# A rank that wrote its error file while srun still runs: srun ends the step by itself (--kill-on-bad-
# exit) within a second, unless a node is really gone, when slurmctld keeps the step RUNNING until it
# marks the node down (85 s here). Past this grace the supervisor ends the step itself.
ERROR_GRACE_S = 3.0
CONTROLLER_WAIT_S = 180.0
# srun's report of the first task that ended badly: `srun: error: n2: task 1: Killed`,
# `srun: error: n1: task 0: Exited with exit code 1`.
_TASK_ENDED = re.compile(r"task (\d+): (Killed|Exited with exit code (\d+)|Terminated)")


class SlurmRuns:
    """Runs in this job's SLURM allocation, one srun step each."""

    def __init__(self, spec: RunSpec, environ: Mapping[str, str], *, requeues: int) -> None:
        self.spec = spec
        self.environ = dict(environ)
        self.requeues = requeues
        self.job_id = environ["SLURM_JOB_ID"]
        self.allocation = allocation_hosts(environ)
        self.srun = environ[SRUN_ENV]
        self.asked = False
        self.warm: WarmParent | None = None
        self.warm_failed = False

    def hosts(self) -> list[str]:
        """The allocation's hosts a step can use now. The first run takes the allocation as SLURM gave
        it; later ones ask squeue and sinfo, waiting out a controller that is away (restarted, say) for
        up to CONTROLLER_WAIT_S before the attempt ends."""
        if not self.asked:
            self.asked = True
            return list(self.allocation)
        deadline = time.monotonic() + CONTROLLER_WAIT_S
        while True:
            try:
                return usable_hosts(self.allocation, self.job_id, self.environ)
            except SlurmQueryError as error:
                if time.monotonic() >= deadline:
                    raise
                log.warning("cannot tell the usable nodes yet (%s); asking again", error)
                time.sleep(2.0)

    def start(self, spec_path: Path, run: int, hosts: list[str]) -> Run:
        warm = self.warm_parents(spec_path)
        if warm is not None and warm.usable(hosts):
            forked = self.fork(warm, spec_path, run, hosts)
            if forked is not None:
                return forked
        return self.step(spec_path, run, hosts)

    def warm_parents(self, spec_path: Path) -> WarmParent | None:
        """The job's warm parents, one on every node of the allocation (spares included) in one srun
        step started at the first run; None when none could import the worker (ranks start cold)."""
        if self.warm is None and not self.warm_failed:
            resources, hosts = self.spec.resources, self.allocation
            argv = [
                self.srun, f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}", "--ntasks-per-node=1",
                f"--cpus-per-task={resources.cpus_per_task * resources.tasks_per_node}",
                f"--nodelist={','.join(hosts)}", "--overlap", "--kill-on-bad-exit=0", "--no-kill",
            ]  # fmt: skip
            if resources.gpus_per_node:
                argv.append(f"--gpus-per-node={resources.gpus_per_node}")
            self.warm = WarmParent([*argv, *warm_parent_command(spec_path)], self.environ, via_srun=True)
            ready = self.warm.wait_ready(hosts, WARM_START_S)
            log.info("warm parents ready on %s", ",".join(sorted(h for h in ready if h)) or "no node")
            self.warm_failed = not ready
        return None if self.warm_failed else self.warm

    def fork(self, warm: WarmParent, spec_path: Path, run: int, hosts: list[str]) -> SlurmForkedRun | None:
        """A run of ranks forked by the warm parents of `hosts`, each with the variables an srun step
        over those hosts would give it; None when a parent did not answer (its ranks are stopped)."""
        tasks = self.spec.resources.tasks_per_node
        world = len(hosts) * tasks
        step = {
            "SLURM_NTASKS": str(world), "SLURM_STEP_NUM_TASKS": str(world), "SLURM_NNODES": str(len(hosts)),
            "SLURM_STEP_NUM_NODES": str(len(hosts)), "SLURM_STEP_NODELIST": ",".join(hosts),
            "SLURM_STEP_TASKS_PER_NODE": f"{tasks}(x{len(hosts)})", RUN_ENV: str(run),
            REQUEUES_ENV: str(self.requeues),
        }  # fmt: skip
        processes: dict[int, RankProcess] = {}
        node_of: dict[int, str] = {}
        for node, host in enumerate(hosts):
            for local in range(tasks):
                rank = node * tasks + local
                env = {**step, "SLURM_PROCID": str(rank), "SLURM_NODEID": str(node),
                       "SLURM_LOCALID": str(local)}
                out = self.rank_log(self.environ[RANK_OUTPUT_ENV], rank)
                err = self.rank_log(self.environ[RANK_ERROR_ENV], rank)
                forked = warm.fork(rank, env, out, err, spec_path, host)
                if forked is None:
                    ProcessRun(self.spec, processes, node_of).stop()
                    return None
                processes[rank], node_of[rank] = forked, host
        log.info("run %d: %d ranks forked on %s", run, world, ",".join(hosts))
        return SlurmForkedRun(self, warm, ProcessRun(self.spec, processes, node_of), hosts)

    def rank_log(self, template: str, rank: int) -> Path:
        """The rank's log file, as srun would name it from the batch script's template."""
        names = {"%j": "SLURM_JOB_ID", "%A": "SLURM_ARRAY_JOB_ID", "%a": "SLURM_ARRAY_TASK_ID"}
        path = template.replace("%t", str(rank))
        for pattern, name in names.items():
            path = path.replace(pattern, self.environ.get(name, ""))
        return Path(path)

    def step(self, spec_path: Path, run: int, hosts: list[str]) -> SlurmRun:
        """A run as one srun step of cold ranks."""
        resources = self.spec.resources
        tasks = resources.tasks_per_node
        argv = [
            self.srun, f"--nodes={len(hosts)}", f"--ntasks={len(hosts) * tasks}",
            f"--ntasks-per-node={tasks}",
            f"--cpus-per-task={resources.cpus_per_task}", f"--nodelist={','.join(hosts)}",
            *SRUN_STEP_FLAGS,
            f"--output={self.environ[RANK_OUTPUT_ENV]}", f"--error={self.environ[RANK_ERROR_ENV]}",
        ]  # fmt: skip
        if resources.gpus_per_node:
            argv.append(f"--gpus-per-node={resources.gpus_per_node}")
        argv += [sys.executable, "-u", "-m", "worker.rank_main", str(spec_path)]
        env = {**self.environ, RUN_ENV: str(run), REQUEUES_ENV: str(self.requeues)}
        # cwd "/": `-m` puts the working folder first on sys.path (see worker.run_local).
        process = subprocess.Popen(argv, env=env, cwd="/", stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        log.info("run %d: srun step on %s (%d ranks)", run, ",".join(hosts), len(hosts) * tasks)
        return SlurmRun(self, process, hosts)


class SlurmForkedRun:
    """A run of forked ranks: a rank that ended says so through its parent; a rank lost (killed, or a
    peer lost) with a node gone from the allocation lost that node (its parent and ranks went with
    it). squeue and sinfo are asked only then, once a run."""

    def __init__(self, runs: SlurmRuns, warm: WarmParent, ranks: ProcessRun, hosts: list[str]) -> None:
        self.runs, self.warm, self.ranks, self.hosts = runs, warm, ranks, hosts

    def ended(self) -> RunEnd | None:
        end = self.ranks.ended()
        if end is None or end.ok or end.cancelled or end.cause != "node_failure":
            return end  # a rank's own exception is the job's failure, whatever the nodes say
        usable = set(self.runs.hosts())
        lost = [host for host in self.hosts if host not in usable]
        for host in lost:
            self.warm.mark_lost(host)
        if not lost:
            return end
        rank = min(rank for rank, host in self.ranks.node_of.items() if host == lost[0])
        return RunEnd(ok=False, cause="node_failure", rank=rank, node=lost[0], detail="node down",
                      lost_node=True)  # fmt: skip

    def settle(self) -> None:
        self.ranks.settle()

    def stop(self) -> None:
        self.ranks.stop()


class SlurmRun:
    """One run: an srun step, and a thread that passes srun's own words on to the log, keeping the
    first task that ended badly."""

    def __init__(self, runs: SlurmRuns, process: subprocess.Popen[bytes], hosts: list[str]) -> None:
        self.runs = runs
        self.process = process
        self.hosts = hosts
        self.first_bad: tuple[int, int] | None = None  # (task, exit status; -9 for Killed)
        self.error_seen_at: float | None = None
        self.reader = threading.Thread(target=self._read, name="srun-stderr", daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip()
            print(line, file=sys.stderr, flush=True)
            match = _TASK_ENDED.search(line)
            if match and self.first_bad is None:
                code = int(match.group(3)) if match.group(3) else -signal.SIGKILL
                self.first_bad = (int(match.group(1)), code if code != 0 else 1)

    def ended(self) -> RunEnd | None:
        code = self.process.poll()
        if code is None and self._errors_outstay_grace():
            log.warning("a rank failed %.0f s ago and the step goes on: ending it", ERROR_GRACE_S)
            self.stop()
            code = self.process.returncode if self.process.returncode != 0 else 1
        if code is None:
            return None
        self.reader.join(timeout=5)
        spec = self.runs.spec
        world_size = len(self.hosts) * spec.resources.tasks_per_node
        if code == 0 or (finished(spec) and not _ranks_with_errors(spec, world_size)):
            # srun says otherwise when the controller was away as the step ended; rank 0's result is
            # the attempt's success for the service too
            return RunEnd(ok=True)
        tasks = self.runs.spec.resources.tasks_per_node
        node_of = {rank: self.hosts[rank // tasks] for rank in range(len(self.hosts) * tasks)}
        usable = set(self.runs.hosts())
        lost = [host for host in self.hosts if host not in usable]
        if lost:
            rank = min(rank for rank, host in node_of.items() if host == lost[0])
            return RunEnd(ok=False, cause="node_failure", rank=rank, node=lost[0], detail="node down",
                          lost_node=True)  # fmt: skip
        exits = dict.fromkeys(_ranks_with_errors(spec, len(node_of)), 1)
        if self.first_bad is not None:
            exits.setdefault(*self.first_bad)
        if not exits:  # srun failed and said nothing of its tasks: the step as a whole
            return RunEnd(ok=False, cause="node_failure", detail=f"the job step ended with exit code {code}")
        return classify(exits, spec.files, spec.attempt, node_of)

    def _errors_outstay_grace(self) -> bool:
        if not _ranks_with_errors(self.runs.spec, len(self.hosts) * self.runs.spec.resources.tasks_per_node):
            self.error_seen_at = None
            return False
        now = time.monotonic()
        if self.error_seen_at is None:
            self.error_seen_at = now
        return now - self.error_seen_at > ERROR_GRACE_S

    def settle(self) -> None:
        """srun ends the step itself once a task failed (--kill-on-bad-exit); one a lost node holds
        is ended after ERROR_GRACE_S (ended())."""
        self.stop()

    def stop(self) -> None:
        """SIGKILL to srun: the step's tasks die within a quarter of a second (SLURM's own word for a
        killed srun), where its double SIGINT took 17 s after a real node loss (docs/slurm.md)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.reader.join(timeout=STOP_WAIT_S)


def finished(spec: RunSpec) -> bool:
    """Rank 0 wrote this attempt's result (service.jobfs reads it as the attempt's success)."""
    try:
        with open(spec.files.result, encoding="utf-8") as handle:
            data = json.loads(handle.read(1_000_000))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("attempt") == spec.attempt


def _ranks_with_errors(spec: RunSpec, world_size: int) -> list[int]:
    return [rank for rank in range(world_size) if os.path.exists(spec.files.error(rank))]
