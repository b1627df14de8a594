"""Rank 0's checkpoints written in the background, so that a save costs training a copy in memory.

One CheckpointWriter per JobContext. A save copies the state (worker.snapshot) and hands the copy to
a thread that writes it; a new save first waits for the write before it, so at most one copy exists
besides the live state. The writing thread, in order:

1. torch.save into a temp file (`.ckpt-<n>.pt.tmp-<pid>`, a name no listing counts), fsync, rename
   to `ckpt-<n>.pt`: the file is whole before it has its name;
2. the note `ckpt-<n>.json` beside it, atomically: from now on the checkpoint is listed and resumed
   from (JobFiles.saved_checkpoints counts a checkpoint only with its note; the service's listing
   the same), so a rank killed at any point before leaves no checkpoint a restart would load;
3. the progress line {"checkpoint", "step", "time", "attempt"}, flushed at once: the ledger never
   names a checkpoint that is not whole;
4. the checkpoint policy's pruning.

A write that fails is logged at once and raised (CheckpointWriteError) at the next save, wait or
close, so it is never lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from worker.files import ProgressWriter, atomic_write_text
from worker.snapshot import Snapshotter
from worker.spec import CheckpointPolicy, JobFiles, parse_checkpoint_note

log = logging.getLogger(__name__)


class CheckpointWriteError(RuntimeError):
    """A checkpoint saved in the background could not be written (its cause is chained)."""


class CheckpointWriter:
    """Writes one checkpoint at a time in a background thread; see the module's docstring."""

    def __init__(self, files: JobFiles, progress: ProgressWriter, policy: CheckpointPolicy | None,
                 attempt: int) -> None:
        self.files = files
        self.policy = policy
        self.attempt = attempt
        self._progress = progress
        self._snapshots = Snapshotter()
        self._thread: threading.Thread | None = None
        self._failed: tuple[Path, BaseException] | None = None

    def save(self, state: Any, step: int, metrics: dict[str, float | None], *, wait: bool) -> Path:
        """Copy `state` now and write it as checkpoint `step` in the background (or at once: `wait`).
        Returns the path it will have; it is whole once the write ends (wait() or the note's arrival)."""
        self.wait()  # the previous write: its buffers are reused, and its error is raised here
        path = self.files.checkpoint_file(step).resolve()
        copied = self._snapshots.copy(state)
        note = {"step": int(step), "metrics": dict(metrics), "attempt": self.attempt}
        self._thread = threading.Thread(target=self._write, args=(copied, path, note), daemon=True,
                                        name=f"checkpoint-{step}")  # fmt: skip
        self._thread.start()
        if wait:
            self.wait()
        return path

    def wait(self) -> None:
        """Until the write under way (if any) ends; CheckpointWriteError if it, or an earlier one, failed."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if self._failed is not None:
            (path, error), self._failed = self._failed, None
            raise CheckpointWriteError(f"checkpoint {path} could not be written: {error!r}") from error

    def _write(self, state: Any, path: Path, note: dict[str, Any]) -> None:
        try:
            self._snapshots.ready()
            write_whole(state, path)
            note["time"] = now = time.time()
            atomic_write_text(self.files.checkpoint_note(path), json.dumps(note) + "\n")
            self._progress.append({"checkpoint": str(path), "step": note["step"], "time": now,
                                   "attempt": self.attempt})  # fmt: skip
            self._progress.flush()
            log.info("saved checkpoint %s", path)
            if self.policy is not None:
                prune(self.files, self.policy)
        except BaseException as error:  # kept for the training thread: raised at its next save or close
            log.error("could not write checkpoint %s", path, exc_info=True)
            self._failed = (path, error)


def write_whole(state: Any, path: Path) -> None:
    """torch.save `state` to `path` atomically: a temp file, fsync-ed, then renamed (removed on failure)."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temp, "wb") as handle:
            torch.save(state, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise


def remove_unfinished(files: JobFiles) -> None:
    """Remove the temp files of writes that never finished (a rank 0 killed while it wrote): they are
    never listed, but they count against the job's disk. Called when rank 0 starts, the only writer."""
    if not files.checkpoints.is_dir():
        return
    for path in files.checkpoints.iterdir():
        if path.name.startswith(".ckpt-") and ".pt.tmp-" in path.name:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()  # a name in the job's own folder: a link goes, never its target
            log.info("removed %s, left by a write that never finished", path.name)


def prune(files: JobFiles, policy: CheckpointPolicy) -> None:
    """Delete the checkpoints (and their notes) that `policy` does not keep."""
    saved = files.saved_checkpoints()
    notes = {path: _note_metrics(files, path) for _, path in saved} if policy.keep_best else {}
    for path in checkpoints_to_remove([path for _, path in saved], notes, policy):
        # The note first: without it the checkpoint is no longer listed, even if its file outlives us.
        for name in (files.checkpoint_note(path), path):
            with contextlib.suppress(FileNotFoundError):
                name.unlink()  # a name in the job's own folder: a link goes, never its target
        log.info("removed checkpoint %s (checkpoint policy)", path)


def _note_metrics(files: JobFiles, checkpoint: Path) -> dict[str, float | None]:
    try:
        return parse_checkpoint_note(files.checkpoint_note(checkpoint).read_text())
    except (OSError, UnicodeDecodeError):
        return {}


def checkpoints_to_remove(saved: list[Path], metrics: dict[Path, dict[str, float | None]],
                          policy: CheckpointPolicy) -> list[Path]:
    """Which of `saved` (oldest first) `policy` lets go: all but the newest `keep_last` (the newest
    always stays: a restart resumes from it) and the best by `keep_best` among those whose note has
    the metric. Nothing goes when the policy has neither rule."""
    if policy.keep_last is None and policy.keep_best is None:
        return []
    kept = set(saved[-(policy.keep_last or 1):])
    if policy.keep_best is not None:
        name, sign = policy.keep_best.metric, 1.0 if policy.keep_best.goal == "min" else -1.0
        scored = [(sign * value, index, path) for index, path in enumerate(saved)
                  if (value := metrics.get(path, {}).get(name)) is not None]
        if scored:
            kept.add(min(scored)[2])  # a tie: the older one, which reached that value first
    return [path for path in saved if path not in kept]
