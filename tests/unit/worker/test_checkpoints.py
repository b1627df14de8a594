"""worker.checkpoints: rank 0's saves written in the background, listed only once whole, their
failures raised at the next save, and a rank killed mid-write leaving nothing a restart would load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.unit.worker.test_worker_context import make
from tests.unit.worker.test_worker_errors import run_script
from worker import checkpoints
from worker.checkpoints import CheckpointWriteError
from worker.context import JobContext
from worker.spec import JobFiles, parse_progress_line

ROOT = Path(__file__).resolve().parents[3]


def checkpoint_lines(ctx: JobContext) -> list[str]:
    if not ctx.files.progress.exists():
        return []
    records = [parse_progress_line(line) for line in ctx.files.progress.read_text().splitlines()]
    return [checkpoint for record in records if (checkpoint := getattr(record, "checkpoint", None))]


class HeldSave:
    """torch.save as the writer calls it, held until released; records what was on disk then."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self._save = torch.save
        monkeypatch.setattr(checkpoints.torch, "save", self)

    def __call__(self, obj: Any, handle: Any) -> None:
        self.started.set()
        assert self.release.wait(30)
        self._save(obj, handle)


def test_a_save_returns_before_the_write_and_the_file_is_whole_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldSave(monkeypatch)
    ctx = make(tmp_path)
    ctx.report(1, loss=0.5)
    weights = torch.arange(1000.0)
    path = ctx.save_checkpoint({"w": weights, "step": 1}, 1)
    assert held.started.wait(10)  # the writer is at torch.save; the training thread has its path back
    assert not path.exists() and not ctx.files.checkpoint_note(path).exists() and checkpoint_lines(ctx) == []
    assert ctx.files.latest_checkpoint() is None
    weights.add_(1)  # training goes on: the checkpoint keeps the values of the save

    threading.Timer(0.3, held.release.set).start()
    started = time.monotonic()
    ctx.close()  # waits for the write
    assert time.monotonic() - started >= 0.2
    assert ctx.files.latest_checkpoint() == path and checkpoint_lines(ctx) == [str(path)]
    state = torch.load(path, weights_only=True)
    assert torch.equal(state["w"], torch.arange(1000.0)) and state["step"] == 1
    assert not [name for name in os.listdir(ctx.checkpoint_dir) if name.startswith(".")]  # no temp left


def test_the_note_and_the_progress_line_come_only_after_the_file_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = make(tmp_path)
    seen: list[tuple[bool, list[str]]] = []
    real_write = checkpoints.atomic_write_text

    def note_written(path: Path, text: str) -> None:
        checkpoint = path.with_suffix(".pt")
        loadable = torch.load(checkpoint, weights_only=True)["step"] == 8  # whole, under its own name
        seen.append((loadable, checkpoint_lines(ctx)))
        real_write(path, text)

    monkeypatch.setattr(checkpoints, "atomic_write_text", note_written)
    path = ctx.save_checkpoint({"step": 8}, 8, wait=True)
    assert seen == [(True, [])]  # the file whole, no progress line yet, when the note was written
    assert checkpoint_lines(ctx) == [str(path)]
    ctx.close()


def test_a_failed_write_is_raised_at_the_next_save_and_at_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ctx = make(tmp_path)
    real_save = torch.save

    def full_disk_at_odd_steps(obj: Any, handle: Any) -> None:
        if obj["step"] % 2 == 0:
            return real_save(obj, handle)
        handle.write(b"half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoints.torch, "save", full_disk_at_odd_steps)
    first = ctx.save_checkpoint({"step": 1}, 1)  # returns: the write fails in the background
    with pytest.raises(CheckpointWriteError, match=r"ckpt-00000001\.pt could not be written") as raised:
        ctx.save_checkpoint({"step": 2}, 2)
    assert isinstance(raised.value.__cause__, OSError)
    assert "could not write checkpoint" in caplog.text  # logged when it happened, too
    assert os.listdir(ctx.checkpoint_dir) == [] and not first.exists()  # its temp file removed

    second = ctx.save_checkpoint({"step": 2}, 2, wait=True)  # the next save works
    ctx.save_checkpoint({"step": 3}, 3)
    with pytest.raises(CheckpointWriteError, match=r"ckpt-00000003\.pt"):
        ctx.close()
    ctx.close()  # told once
    assert ctx.files.latest_checkpoint() == second and checkpoint_lines(ctx) == [str(second)]


KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from worker import checkpoints
from tests.unit.worker.test_worker_context import make
from tests.unit.worker.test_worker_errors import run_script

folder, where = Path(sys.argv[1]), sys.argv[2]
ctx = make(folder)
ctx.save_checkpoint({"step": 1, "w": torch.ones(10)}, 1, wait=True)
real_save, real_write = torch.save, checkpoints.atomic_write_text

def stopped() -> None:
    (folder / "writing").touch()
    time.sleep(600)  # killed here

def half_written(obj, handle) -> None:
    real_save(obj, handle)
    handle.truncate(handle.tell() // 2)  # half of it on disk, under the temp name
    handle.flush()
    stopped()

def before_the_note(path, text) -> None:
    stopped()  # the file whole and renamed; its note not yet written

if where == "file":
    checkpoints.torch.save = half_written
else:
    checkpoints.atomic_write_text = before_the_note
ctx.save_checkpoint({"step": 2, "w": torch.zeros(10_000)}, 2)
time.sleep(600)
"""


@pytest.mark.parametrize("where", ["file", "note"])
def test_a_rank_killed_while_it_writes_leaves_the_previous_checkpoint_the_latest(
    tmp_path: Path, where: str
) -> None:
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    folder = tmp_path / "job"
    rank = subprocess.Popen([sys.executable, str(script), str(folder), where], cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (folder / "writing").exists():
            assert rank.poll() is None and time.monotonic() < deadline, "the writer never got there"
            time.sleep(0.05)
        os.kill(rank.pid, signal.SIGKILL)
    finally:
        rank.kill()
        rank.wait()
    files = JobFiles(folder)
    names = sorted(os.listdir(files.checkpoints))
    if where == "file":
        assert any(name.startswith(".ckpt-00000002.pt.tmp-") for name in names)  # the half file is there
    else:
        assert "ckpt-00000002.pt" in names and "ckpt-00000002.json" not in names
    latest = files.latest_checkpoint()
    assert latest == files.checkpoint_file(1)
    assert torch.load(latest, weights_only=True)["step"] == 1  # what a restart loads
    resumed = make(folder)
    assert resumed.resume_from is not None and resumed.resume_from.resolve() == latest.resolve()
    assert not any(".tmp-" in name for name in os.listdir(files.checkpoints))  # the restart cleared the half


SAVES_THEN = """
from worker.context import current
current().save_checkpoint({"step": 4}, 4)
"""


class SlowSave:
    """torch.save that takes a while, noting which of the rank's own files existed once it was done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, files: JobFiles) -> None:
        self.files = files
        self.seen: list[tuple[bool, bool]] = []
        self._save = torch.save
        monkeypatch.setattr(checkpoints.torch, "save", self)

    def __call__(self, obj: Any, handle: Any) -> None:
        time.sleep(0.5)
        self._save(obj, handle)
        self.seen.append((self.files.result.exists(), self.files.error(0).exists()))


@pytest.mark.parametrize("ends", ["returns", "raises"])
def test_the_run_s_last_checkpoint_is_whole_before_its_result_or_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ends: str
) -> None:
    slow = SlowSave(monkeypatch, JobFiles(tmp_path))
    body = SAVES_THEN + ("raise KeyError('after the save')\n" if ends == "raises" else "")
    if ends == "raises":
        spec = run_script(tmp_path, monkeypatch, body)
        assert spec.files.error(0).exists()
    else:
        spec = run_script(tmp_path, monkeypatch, body, fails=False)
        assert spec.files.result.exists()
    assert slow.seen == [(False, False)]  # written before the runner told the service how it ended
    assert spec.files.latest_checkpoint() == spec.files.checkpoint_file(4)
