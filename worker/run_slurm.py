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
from worker.slurm_nodes import SRUN_STEP_FLAGS, SlurmQueryError, allocation_hosts, usable_hosts
from worker.spec import RANK_ERROR_ENV, RANK_OUTPUT_ENV, SRUN_ENV, RunSpec
from worker.supervisor import RunEnd, classify

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

    def start(self, spec_path: Path, run: int, hosts: list[str]) -> SlurmRun:
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
