"""The job's supervisor: it starts the ranks of an attempt and, when one is lost, restarts them all in
place, inside the same allocation, from the newest whole checkpoint.

It runs once per allocation, as the job's own account: under submitit's local controller as its one
task, on SLURM in the batch script on the batch host (worker.launch.Supervisor is what submitit
pickles). Each run of the ranks is started by a `Runs` of the allocation's kind: one process per rank
locally (worker.run_local), one srun job step on SLURM (worker.run_slurm). Neither torch nor the
service is imported here: the ranks import torch, each in its own process (worker.rank_main).

A run ends in one of three ways:
- every rank returned: the attempt succeeded (rank 0 wrote result.json);
- a rank was lost (killed, vanished, its node down), raised, or the service asked for a restart
  (restart-request.json: the watchdog found the run hung): the supervisor stops every rank, and when
  the cause is in `restarts.on` and restarts are left it starts a new run on the usable nodes (a
  lost node left out, a spare taken), with the same world size, resuming from the newest checkpoint;
- otherwise the attempt ends as it did before supervisors: the ranks' error files tell the service
  why, and a "gave_up" line in restarts.jsonl says why it was not restarted in place.
Every restart is a line of restarts.jsonl (worker.spec.RestartRecord), which the service reads.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from worker.files import atomic_write_text
from worker.spec import (
    LOST_PEER,
    JobFiles,
    RestartCause,
    RestartRequest,
    RunSpec,
    parse_error_text,
    parse_restart_request,
)

log = logging.getLogger("worker.supervisor")

POLL_S = 0.05  # how often the supervisor looks at its ranks and for the service's restart request
MAX_REQUEST_BYTES = 64 * 1024  # restart-request.json is the service's; read bounded all the same


class AttemptEnded(RuntimeError):
    """The attempt ends here, not restarted in place; the ranks' error files say why it failed."""


class AttemptCancelled(KeyboardInterrupt):
    """A rank was cancelled (SIGINT): the whole job is being cancelled, nothing is restarted."""


@dataclass(frozen=True)
class RunEnd:
    """How one run of the ranks ended. `ok`: every rank returned. Otherwise the cause, the rank (and
    its node) lost first, in words, and whether that node may not be used again."""

    ok: bool
    cause: RestartCause | None = None
    rank: int | None = None
    node: str | None = None
    detail: str = ""
    lost_node: bool = False
    cancelled: bool = False


class Run(Protocol):
    """One run of the ranks, started by Runs.start."""

    def ended(self) -> RunEnd | None:
        """None while the run goes on; how it ended once a rank failed (the others may still run:
        stop() or settle() ends them) or all returned."""

    def stop(self) -> None:
        """End every rank of the run now and wait until they are gone."""

    def settle(self) -> None:
        """The attempt ends with this run: let the ranks that lost a peer end by themselves for a few
        seconds (their error files tell the service why), then stop what is left."""


class Runs(Protocol):
    """How runs of the ranks start on this kind of allocation."""

    def hosts(self) -> list[str]:
        """The allocation's hosts that can run ranks now, in order (the batch host first)."""

    def start(self, spec_path: Path, run: int, hosts: list[str]) -> Run:
        """Start run `run` of the ranks of the RunSpec in `spec_path` on `hosts`."""


def supervise(spec: RunSpec, runs: Runs) -> None:
    """Run the attempt of `spec` to its end, restarting in place as spec.restarts allows.

    Returns when every rank returned; raises AttemptEnded when the attempt failed and is not
    restarted, AttemptCancelled when it was cancelled."""
    files, policy = spec.files, spec.restarts
    needed = spec.resources.nodes
    lost: list[str] = []
    restarts, resume_from = 0, spec.resume_from
    ended: tuple[RunEnd, float] | None = None  # the run a restart replaces, and when it was lost
    while True:
        hosts = [host for host in runs.hosts() if host not in lost][:needed]
        run_spec = spec.model_copy(update={"resume_from": resume_from})
        clear_run_files(files, spec.resources.world_size)
        atomic_write_text(files.spec, run_spec.model_dump_json(indent=2))
        run = runs.start(files.spec, restarts, hosts)
        if ended is not None:
            write_record(files, restarted_record(spec, restarts, ended, hosts, resume_from))
        try:
            end, lost_at = watch(run, files, spec.attempt, restarts)
        except BaseException:
            run.stop()  # a cancel, a requeue (submitit's SystemExit): no rank outlives the supervisor
            raise
        if end.ok:
            return
        if end.cancelled:
            run.settle()
            raise AttemptCancelled(end.detail)
        log.warning("run %d of attempt %d ended: %s", restarts, spec.attempt, describe(end))
        if end.cause not in policy.on or policy.max == 0:  # restarts off for it: the attempt ends as ever
            off = "restarts in place are off (restarts.max 0)" if policy.max == 0 else \
                f"{end.cause} is not in restarts.on"
            if end.cause != "failure":  # the service is told what was lost (srun's word, a signal)
                write_record(files, gave_up_record(spec, restarts, end, lost_at, off))
            run.settle()
            raise AttemptEnded(f"{describe(end)}: {off}")
        if end.lost_node and end.node is not None:
            lost.append(end.node)
        usable = [host for host in runs.hosts() if host not in lost]
        why = gave_up_reason(restarts, policy.max, len(usable), needed)
        if why is not None:
            write_record(files, gave_up_record(spec, restarts, end, lost_at, why))
            run.settle()
            raise AttemptEnded(f"{describe(end)}; {why}")
        run.stop()  # a restart: at once
        restarts += 1
        latest = files.latest_checkpoint()
        resume_from = str(latest) if latest is not None else spec.resume_from
        ended = (end, lost_at)


def watch(run: Run, files: JobFiles, attempt: int, number: int) -> tuple[RunEnd, float]:
    """Wait for the run to end, or for the service to ask for its restart; (how, when)."""
    while True:
        end = run.ended()
        if end is not None:
            return end, time.time()
        request = read_request(files)
        if request is not None and request.attempt == attempt and request.run == number:
            lost_at = time.time()
            log.warning("the service asks for a restart of run %d: %s", number,
                        request.detail or request.cause)
            run.stop()
            files.restart_request.unlink(missing_ok=True)
            cause: RestartCause = "failure" if request.cause == "failure" else (
                "node_failure" if request.cause == "node_failure" else "hang")
            return RunEnd(ok=False, cause=cause, detail=request.detail or "stalled"), lost_at
        time.sleep(POLL_S)


def read_request(files: JobFiles) -> RestartRequest | None:
    """The service's restart request, if there is one (a torn or unusable one is none)."""
    try:
        with open(files.restart_request, "rb") as handle:
            text = handle.read(MAX_REQUEST_BYTES)
    except OSError:
        return None
    return parse_restart_request(text)


def gave_up_reason(restarts: int, most: int, usable: int, needed: int) -> str | None:
    """Why the attempt is not restarted in place, or None."""
    if restarts >= most:
        return f"restarts spent ({restarts} of {most})"
    if usable < needed:
        spare = "no spare node: " if usable == needed - 1 else ""
        return f"{spare}the allocation holds {usable} usable node{'s' * (usable != 1)} of {needed} needed"
    return None


def describe(end: RunEnd) -> str:
    """`rank 1 on n2 lost (node down)` and the like."""
    who = "a rank" if end.rank is None else f"rank {end.rank}"
    where = f" on {end.node}" if end.node else ""
    if end.cause == "hang":
        return f"stalled ({end.detail})" if end.detail else "stalled"
    verb = "raised" if end.cause == "failure" else "lost"
    return f"{who}{where} {verb} ({end.detail})" if end.detail else f"{who}{where} {verb}"


def classify(exits: dict[int, int], files: JobFiles, attempt: int, node_of: dict[int, str]) -> RunEnd:
    """How a run ended, from the ranks that ended so far (rank -> exit status, negative: a signal) and
    the error files of all the run's ranks (`node_of`'s): a rank killed by a signal without a word
    (lost: node_failure) before one that raised on its own or exited non-zero by itself (failure),
    those before ranks that only lost a peer. A rank that raised is read even while it is still on its
    way out: the peer it left may exit first, and would else be taken for a rank that lost a node."""
    errors = rank_errors(files, attempt, sorted(set(node_of) | set(exits)))
    cancelled = [rank for rank, code in exits.items() if code in (130, -2)]
    if cancelled and len(cancelled) == len([code for code in exits.values() if code != 0]):
        return RunEnd(ok=False, cancelled=True, rank=cancelled[0], detail="cancelled")
    vanished = [rank for rank, code in sorted(exits.items()) if code < 0 and rank not in errors]
    if vanished:  # killed by a signal (kill -9, the OOM killer, its node going down) before it said a word
        rank = vanished[0]
        detail = f"killed by {signal_name(-exits[rank])}"
        return RunEnd(ok=False, cause="node_failure", rank=rank, node=node_of.get(rank), detail=detail)
    own = [rank for rank, text in sorted(errors.items()) if not LOST_PEER.search(text)]
    if own:
        last = errors[own[0]].strip().splitlines()[-1:] or ["an error"]
        return RunEnd(ok=False, cause="failure", rank=own[0], node=node_of.get(own[0]), detail=last[0][:200])
    exited = [rank for rank, code in sorted(exits.items()) if code > 0 and rank not in errors]
    if exited:  # its own exit (os._exit, a C library's exit()): the job's doing, not a lost rank
        rank = exited[0]
        detail = f"exit code {exits[rank]} without a traceback"
        return RunEnd(ok=False, cause="failure", rank=rank, node=node_of.get(rank), detail=detail)
    first = min(errors) if errors else None
    return RunEnd(ok=False, cause="node_failure", rank=None, node=None,
                  detail=f"rank {first} lost a peer" if first is not None else "a peer vanished")


def rank_errors(files: JobFiles, attempt: int, ranks: list[int]) -> dict[int, str]:
    """The error files of `ranks` written in `attempt` (this run's: clear_run_files removed the others)."""
    found = {}
    for rank in ranks:
        try:
            with open(files.error(rank), encoding="utf-8", errors="replace") as handle:
                written, text = parse_error_text(handle.read(64 * 1024))
        except OSError:
            continue
        if written == attempt:
            found[rank] = text
    return found


def clear_run_files(files: JobFiles, world_size: int) -> None:
    """Before a run: the error and placement files of the run it replaces are not this run's (a rank
    that never starts again would leave its old ones standing, and the service would read the lost
    node as a place of this run)."""
    for rank in range(world_size):
        files.error(rank).unlink(missing_ok=True)
        files.placement(rank).unlink(missing_ok=True)


def signal_name(number: int) -> str:
    import signal

    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def restarted_record(spec: RunSpec, restart: int, ended: tuple[RunEnd, float], hosts: list[str],
                     resume_from: str | None) -> dict[str, object]:
    end, lost_at = ended
    return {
        "attempt": spec.attempt, "restart": restart, "outcome": "restarted", "cause": end.cause,
        "rank": end.rank, "node": end.node, "detail": end.detail, "lost_at": lost_at,
        "started_at": time.time(), "resumed_from": resume_from, "resumed_step": checkpoint_step(resume_from),
        "nodes": hosts, "max": spec.restarts.max,
    }


def gave_up_record(spec: RunSpec, restarts: int, end: RunEnd, lost_at: float,
                   reason: str) -> dict[str, object]:
    return {
        "attempt": spec.attempt, "restart": restarts, "outcome": "gave_up", "cause": end.cause,
        "rank": end.rank, "node": end.node, "detail": end.detail, "lost_at": lost_at,
        "max": spec.restarts.max, "reason": reason,
    }


def checkpoint_step(path: str | None) -> int | None:
    from worker.spec import CHECKPOINT_PATTERN

    match = CHECKPOINT_PATTERN.fullmatch(Path(path).name) if path else None
    return int(match.group(1)) if match else None


def write_record(files: JobFiles, record: dict[str, object]) -> None:
    """Append one line to restarts.jsonl (one write of a whole line, so a reader sees it whole or not)."""
    line = (json.dumps(record) + "\n").encode()
    descriptor = os.open(files.restarts, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.write(descriptor, line)
    finally:
        os.close(descriptor)
    log.info("restart record: %s", record)


def run_supervised(spec: RunSpec, *, requeues: int) -> None:
    """The supervisor of `spec`'s attempt in the allocation it runs in: SLURM's (its batch step) or
    this machine's (submitit's local controller)."""
    from worker.distributed import rank_source, scheduler_job_id

    if rank_source(os.environ) == "slurm":
        from worker.run_slurm import SlurmRuns

        runs: Runs = SlurmRuns(spec, os.environ, requeues=requeues)
    else:
        from worker.run_local import LocalRuns

        external_id = scheduler_job_id(os.environ, fallback=spec.job_id)
        runs = LocalRuns(spec, requeues=requeues, external_id=external_id)
    log.info("job %s attempt %d: supervising %d rank(s), restarts %s", spec.job_id, spec.attempt,
             spec.resources.world_size, spec.restarts.model_dump())
    supervise(spec, runs)
