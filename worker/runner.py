"""One rank's run: the entrypoint (function or torchrun-style script), its result and its failure.

Failure policy, so that no rank waits forever for a dead peer:
- names and paths are resolved before the rendezvous, so a typo fails every rank at once;
- the rendezvous (waiting for rank 0's port file, connecting) and the process group have a bounded
  timeout (spec.rendezvous_timeout_s);
- a rank that raises writes error-rank{r}.txt (first line `attempt: <n>`), then leaves the group and
  exits non-zero; its closed sockets make the peers' pending gloo collectives fail at once, and a
  watchdog ends the process if teardown itself hangs (NCCL with work in flight).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import runpy
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.checkpoints import CheckpointWriteError
from worker.context import JobContext, set_current
from worker.distributed import RankEnv, init_process_group, teardown
from worker.files import atomic_write_text, write_error, write_placement, write_result
from worker.rendezvous import rendezvous_key, rendezvous_port, rendezvous_store
from worker.spec import ATTEMPT_ENV, JOB_ID_ENV, RUN_ID_ENV, UPSTREAM_ENV, RunSpec

log = logging.getLogger("worker")

EXIT_GRACE_S = 20.0  # how long a failed rank may take to leave before it is ended with os._exit(1)


def run_rank(spec: RunSpec, env: RankEnv) -> Any:
    """Run the attempt's entrypoint on this rank; rank 0 writes result.json when it returns."""
    files = spec.files
    files.error(env.rank).unlink(missing_ok=True)  # a requeued run starts clean
    gpu = env.visible_gpus[env.gpu] if env.gpu is not None and env.gpu < len(env.visible_gpus) else env.gpu
    write_placement(files.placement(env.rank), spec.attempt, env.rank, env.local_rank,
                    None if gpu is None else str(gpu))  # fmt: skip
    if env.is_main:
        # What this attempt runs with, for a person reading the folder. Written here rather than at
        # dispatch: a file per job less on the dispatcher's path, where thousands go out at once.
        # Before the rendezvous: the other ranks, connected, find upstream.json written.
        atomic_write_text(files.spec, spec.model_dump_json(indent=2))
        if spec.upstream:
            upstream = [one.model_dump(mode="json") for one in spec.upstream]
            atomic_write_text(files.upstream, json.dumps(upstream, indent=2))
    os.environ.update(identity_vars(spec))
    contexts: list[JobContext] = []
    try:
        if spec.entrypoint is not None:
            value = _run_function(spec, env, contexts)
        else:
            value = _run_script(spec, env, contexts)
        for ctx in contexts:
            ctx.close()  # the last checkpoint whole and the progress lines landed before the result
        if env.is_main:
            write_result(files.result, spec.attempt, value)
            log.info("result written to %s", files.result)
        return value
    except BaseException as error:
        _close(contexts)  # the last checkpoint whole before the service hears of the failure
        _on_failure(spec, env, error)
        raise
    finally:
        _close(contexts)
        set_current(None)
        teardown()


def _close(contexts: list[JobContext]) -> None:
    """Close each context (again: it is idempotent) on the way out of a failed run, whose own error is
    the one to tell: a checkpoint write that failed too was logged when it failed."""
    for ctx in contexts:
        try:
            ctx.close()
        except CheckpointWriteError:
            pass
        except OSError:  # progress lines that could not be written must not hide the run's error
            log.warning("could not close the job context", exc_info=True)


def identity_vars(spec: RunSpec) -> dict[str, str]:
    """Who this rank's run is, for scripts and experiment trackers: the job, a run id that stays the
    same over retries and requeues (wandb.init(id=..., resume="allow")), the attempt, and where the
    jobs it ran after are described."""
    found = {JOB_ID_ENV: str(spec.job_id), RUN_ID_ENV: spec.run_name, ATTEMPT_ENV: str(spec.attempt)}
    if spec.upstream:
        found[UPSTREAM_ENV] = str(spec.files.upstream)
    return found


def resolve_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """`package.module:function` -> the function (imported now, before any rendezvous)."""
    module_name, _, attribute = entrypoint.partition(":")
    function = getattr(importlib.import_module(module_name), attribute)
    if not callable(function):
        raise TypeError(f"entrypoint {entrypoint!r} is not callable")
    return function  # type: ignore[no-any-return]


def _run_function(spec: RunSpec, env: RankEnv, contexts: list[JobContext]) -> Any:
    assert spec.entrypoint is not None
    function = resolve_entrypoint(spec.entrypoint)
    path = spec.files.rendezvous(rendezvous_key(env, spec.attempt))
    env, store = rendezvous_store(env, path, timeout_s=spec.rendezvous_timeout_s)
    backend = init_process_group(env, timeout_s=spec.rendezvous_timeout_s, store=store)
    ctx = JobContext(spec, env, backend=backend)
    contexts.append(ctx)
    set_current(ctx)
    log.info("calling %s with %s", spec.entrypoint, ctx)
    return function(ctx, **spec.kwargs)


def _run_script(spec: RunSpec, env: RankEnv, contexts: list[JobContext]) -> Any:
    """Run a torchrun-style script as `python script args...` would, with torchrun's variables set;
    worker.context.current() gives it a JobContext when it asks for one."""
    assert spec.script is not None
    script = script_path(spec)
    path = spec.files.rendezvous(rendezvous_key(env, spec.attempt))
    env = rendezvous_port(env, path, timeout_s=spec.rendezvous_timeout_s)
    os.environ.update(env.torchrun_vars())  # the script calls init_process_group("env://") itself

    def script_context() -> JobContext:
        import torch.distributed as dist

        backend = str(dist.get_backend()) if dist.is_available() and dist.is_initialized() else "gloo"
        ctx = JobContext(spec, env, backend=backend)
        contexts.append(ctx)  # closed (its progress written) before the result is
        return ctx

    set_current(script_context)
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *spec.args]
    sys.path.insert(0, str(script.parent))
    log.info(
        "running script %s %s (master %s:%d)", script, " ".join(spec.args), env.master_addr, env.master_port
    )
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exit_:
        if exit_.code not in (None, 0):
            raise
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return None  # a script has no return value; result.json records that it finished


def script_path(spec: RunSpec) -> Path:
    """The script to run: an absolute path as the service resolved it, or a file of the job's code."""
    assert spec.script is not None
    if Path(spec.script).is_absolute() or spec.code is None:
        script = Path(spec.script).resolve()
    else:
        code = spec.files.code.resolve()
        script = (code / spec.script).resolve()
        if not script.is_relative_to(code):
            raise ValueError(f"script {spec.script} lies outside the job's code")
    if not script.is_file():
        raise FileNotFoundError(f"script {script} does not exist")
    return script


def _on_failure(spec: RunSpec, env: RankEnv, error: BaseException) -> None:
    """Leave the traceback where the service looks, unless this was a cancel. (A preemption or requeue
    reaches the supervisor alone, which stops the ranks with SIGTERM: no exception, no error file.)"""
    if isinstance(error, KeyboardInterrupt):  # the local executor cancels with SIGINT
        log.warning("cancelled (KeyboardInterrupt)")
        return
    text = traceback.format_exc()
    # An error file this rank wrote during this run (run_rank removed any older one) tells the first
    # error, the cause; what ends the rank after it, often because of it, goes to the log only. Else
    # the service's reason would depend on whether it read the file before this line or after it.
    if spec.files.error(env.rank).exists():
        log.warning("rank %d already wrote its error file; this one goes to the log only", env.rank)
    else:
        try:
            write_error(spec.files.error(env.rank), spec.attempt, text)
        except OSError:
            log.exception("could not write %s", spec.files.error(env.rank))
    log.error("rank %d failed:\n%s", env.rank, text)
    _arm_exit_watchdog(EXIT_GRACE_S)


def _arm_exit_watchdog(grace_s: float) -> None:
    """End this process with status 1 if it has not exited `grace_s` from now (a hung teardown)."""

    def _exit() -> None:
        log.error("still alive %.0fs after failing; exiting hard", grace_s)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(grace_s, _exit)
    timer.daemon = True
    timer.start()

