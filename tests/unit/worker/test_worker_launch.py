"""RankLauncher in this process (a single rank, no scheduler): result, error file, requeue, env, logs."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle  # type: ignore[import-untyped]
import pytest
from submitit.helpers import DelayedSubmission

from tests.support import ROOT
from worker import distributed
from worker.launch import RankLauncher, apply_env, setup_logging
from worker.spec import RunSpec, parse_activity, parse_error_text
from worker.stacks import uninstall_stack_dumps


def make_spec(tmp_path: Path, **fields: Any) -> RunSpec:
    return RunSpec.model_validate({"job_id": os.getpid(), "name": "unit", "folder": str(tmp_path),
                                   "rendezvous_timeout_s": 30, **fields})


@pytest.fixture
def bare_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No scheduler variables, and the environment and root handlers put back afterwards."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "SUBMITIT_")) or name in distributed.RANK_ENV_NAMES:
            monkeypatch.delenv(name)
    handlers = list(logging.getLogger().handlers)
    environ = dict(os.environ)  # apply_env writes os.environ directly (OMP_NUM_THREADS, the job's env)
    yield
    uninstall_stack_dumps()  # a launcher run here left SIGURG's dump and its activity thread
    logging.getLogger().handlers[:] = handlers
    os.environ.clear()
    os.environ.update(environ)


def test_launcher_pickles_as_plain_json(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, entrypoint="worker.tasks.faults:hostnames")
    launcher = RankLauncher(spec)
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, pickle.loads)):
        again = loads(dumps(launcher))
        assert again.spec == spec and again.spec_json == RankLauncher(spec.model_dump_json()).spec_json
        assert b"worker.spec" not in dumps(launcher)  # RunSpec's own module path is in no pickle


def test_checkpoint_requeues_a_fresh_launcher_resuming_from_the_newest(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, entrypoint="worker.tasks.train:train")
    assert RankLauncher(spec).checkpoint().function.spec.resume_from is None
    spec.files.checkpoints.mkdir()
    for step in (4, 12):
        spec.files.checkpoint_file(step).write_bytes(b"")
        spec.files.checkpoint_note(spec.files.checkpoint_file(step)).write_text("{}")
    spec.files.checkpoint_file(16).write_bytes(b"")  # no note: rank 0 was stopped while it wrote it
    delayed = RankLauncher(spec).checkpoint()
    assert isinstance(delayed, DelayedSubmission)
    fresh = delayed.function
    assert isinstance(fresh, RankLauncher) and delayed.args == () and delayed.kwargs == {}
    assert fresh.spec.resume_from == str(spec.files.checkpoint_file(12))
    assert fresh.spec.attempt == spec.attempt
    # Each hand-back counts: the requeued run rendezvouses under a new key (submitit-local keeps the id).
    assert fresh.requeues == 1 and fresh.checkpoint().function.requeues == 2
    assert pickle.loads(pickle.dumps(fresh)).requeues == 1


def test_a_launcher_pickled_before_requeues_existed_still_loads(tmp_path: Path) -> None:
    launcher = RankLauncher(make_spec(tmp_path, entrypoint="m:f"))
    del launcher.__dict__["requeues"]  # what unpickling an older launcher leaves
    assert launcher.requeues == 0


def test_function_mode_writes_rank0_result(tmp_path: Path, bare_process: None) -> None:
    spec = make_spec(tmp_path, entrypoint="worker.tasks.faults:hostnames", attempt=3)
    value = RankLauncher(spec)()
    assert value["ok"] and value["world_size"] == 1
    assert json.loads(spec.files.result.read_text()) == {"attempt": 3, "value": value}
    assert spec.files.stacks(0).is_file()  # SIGURG's dump was in place before the entrypoint ran
    activity = parse_activity(spec.files.activity(0).read_text())
    assert activity is not None and (activity.attempt, activity.rank, activity.pid) == (3, 0, os.getpid())
    (published,) = (spec.files.folder / "rendezvous").iterdir()
    assert published.name == f"{spec.job_id}-a3-r0.json"  # no scheduler: the service's id stands in
    import torch.distributed as dist

    assert not dist.is_initialized(), "the process group is always destroyed"


def test_a_raising_entrypoint_leaves_its_traceback(tmp_path: Path, bare_process: None,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.runner

    armed: list[float] = []
    monkeypatch.setattr(worker.runner, "_arm_exit_watchdog", armed.append)  # it would end pytest
    spec = make_spec(tmp_path, entrypoint="worker.tasks.faults:raise_on_rank", kwargs={"rank": 0})
    with pytest.raises(RuntimeError, match="deliberate failure"):
        RankLauncher(spec)()
    attempt, text = parse_error_text(spec.files.error(0).read_text())
    assert attempt == spec.attempt == 1
    assert text.startswith("Traceback") and "RuntimeError: deliberate failure (rank 0)" in text
    assert armed == [worker.runner.EXIT_GRACE_S] and not spec.files.result.exists()


def test_a_bad_entrypoint_fails_before_any_rendezvous(tmp_path: Path, bare_process: None,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import worker.runner

    monkeypatch.setattr(worker.runner, "_arm_exit_watchdog", lambda grace_s: None)
    monkeypatch.setattr(worker.runner, "init_process_group", pytest.fail)
    with pytest.raises(ModuleNotFoundError):
        RankLauncher(make_spec(tmp_path, entrypoint="no_such_module:f"))()
    text = make_spec(tmp_path, entrypoint="m:f").files.error(0).read_text()
    assert text.startswith("attempt: 1\nTraceback") and "ModuleNotFoundError" in text


def test_an_underivable_rank_leaves_an_error_file_with_its_attempt(tmp_path: Path, bare_process: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SUBMITIT_LOCAL_GLOBALID", "1")
    monkeypatch.setenv("SUBMITIT_LOCAL_NTASKS", "1")  # rank 1 of 1: refused
    spec = make_spec(tmp_path, entrypoint="m:f", attempt=4)
    with pytest.raises(ValueError, match="outside world size"):
        RankLauncher(spec)()
    assert parse_error_text(spec.files.error(1).read_text())[0] == 4


def test_apply_env_sets_the_jobs_env_but_not_the_rank_variables(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TORCHYARD_TEST_VAR", "RANK", "OMP_NUM_THREADS", "TMPDIR", "TORCHYARD_JOB_DIR"):
        monkeypatch.setenv(name, "")  # recorded, so that whatever apply_env sets is undone afterwards
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)  # likewise the working directory
    spec = make_spec(tmp_path, entrypoint="m:f", env={"TORCHYARD_TEST_VAR": "yes", "RANK": "9"},
                     resources={"cpus_per_task": 3})
    spec.files.folder.mkdir(parents=True, exist_ok=True)
    apply_env(spec)
    assert os.environ["TORCHYARD_TEST_VAR"] == "yes" and "RANK" not in os.environ
    assert os.environ["OMP_NUM_THREADS"] == "3"
    # The rank works in its job's folder and keeps its temporary files there, whoever started it where.
    assert Path.cwd() == spec.files.folder and os.environ["TORCHYARD_JOB_DIR"] == str(spec.files.folder)
    assert os.environ["TMPDIR"] == str(spec.files.tmp) and tempfile.gettempdir() == str(spec.files.tmp)
    assert spec.files.tmp.stat().st_mode & 0o777 == 0o700


def test_log_lines_carry_the_rank(bare_process: None) -> None:
    setup_logging(3)
    setup_logging(3)  # idempotent: one handler
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_torchyard_rank", None) is not None]
    assert len(ours) == 1
    record = logging.LogRecord("worker", logging.INFO, __file__, 1, "hello", None, None)
    assert ours[0].format(record).startswith("[rank 3] ") and ours[0].filter(record)
    assert not ours[0].filter(logging.LogRecord("submitit", logging.INFO, __file__, 1, "x", None, None))


# A rank started from a process that ignores SIGINT (a shell's background job) inherits that.
IGNORING_PARENT = """
import signal, subprocess, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
sys.exit(subprocess.call([sys.executable, "-c", sys.argv[1]]))
"""
RANK = """
import os, signal, time
from worker.launch import take_cancel_signal
print("inherited ignored:", signal.getsignal(signal.SIGINT) == signal.SIG_IGN, flush=True)
take_cancel_signal()
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
    print("SIGINT was ignored")
except KeyboardInterrupt:
    print("cancelled")
"""


def test_a_rank_takes_sigint_as_a_cancel_even_when_its_parent_ignored_it() -> None:
    """The local backend cancels ranks with SIGINT."""
    done = subprocess.run(
        [sys.executable, "-c", IGNORING_PARENT, RANK], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines() == ["inherited ignored: True", "cancelled"], done.stdout + done.stderr
