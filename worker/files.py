"""Writing the job folder's files so that the service, reading them at any moment, never sees half a file.

result.json and error files appear whole (write a temp file, fsync, os.replace); progress.jsonl only
ever grows by whole lines (one O_APPEND write per flush), and the training loop never waits for disk:
report() appends to a list and a background thread writes at most every `interval_s`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worker.spec import ERROR_ATTEMPT_PREFIX, node_hardlinks_protected

log = logging.getLogger(__name__)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: a reader sees the old file, or the new one whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


def write_error(path: Path, attempt: int, text: str) -> None:
    """A rank's error file, atomically: a first line `attempt: <n>` (ERROR_ATTEMPT_PREFIX), then `text`.

    The attempt line lets a reader tell this attempt's error from one an earlier attempt left in the
    same folder (see worker.spec.parse_error_text).
    """
    atomic_write_text(path, f"{ERROR_ATTEMPT_PREFIX}{attempt}\n{text}")


def to_jsonable(value: Any) -> Any:
    """`value` made JSON-able: 1-element tensors and numpy scalars to numbers, Paths to str, else repr."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # NaN is not JSON
    if isinstance(value, Mapping):
        return {str(key): to_jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(item) for item in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    item = getattr(value, "item", None)  # torch tensors and numpy scalars, without importing either
    if callable(item) and getattr(value, "ndim", 0) == 0:
        return to_jsonable(item())
    tolist = getattr(value, "tolist", None)
    if callable(tolist):
        return to_jsonable(tolist())
    return repr(value)


def write_placement(path: Path, attempt: int, rank: int, local_rank: int, gpu: str | None) -> None:
    """A rank's placement file (worker.spec.parse_placement reads it), with its node's
    fs.protected_hardlinks, which the service cannot see from its own host."""
    host = socket.gethostname()
    record = {"attempt": attempt, "rank": rank, "host": host, "local_rank": local_rank, "gpu": gpu,
              "pid": os.getpid(),  # for a person (or a test) after the rank's process
              "protected_hardlinks": node_hardlinks_protected()}  # fmt: skip
    atomic_write_text(path, json.dumps(record) + "\n")


def write_result(path: Path, attempt: int, value: Any) -> None:
    """rank 0's result.json: {"attempt": n, "value": <the entrypoint's return value, JSON-able>}."""
    atomic_write_text(path, json.dumps({"attempt": attempt, "value": to_jsonable(value)}) + "\n")


class ProgressWriter:
    """Buffered appends of JSON lines to one file, flushed by a daemon thread every `interval_s`."""

    def __init__(self, path: Path, *, interval_s: float = 0.5) -> None:
        self.path = path
        self.interval_s = interval_s
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def append(self, record: Mapping[str, Any]) -> None:
        """Queue one line; costs a json.dumps and a list append, never a write."""
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._pending.append(line)
            if self._thread is None and not self._stop.is_set():
                self._thread = threading.Thread(target=self._run, name="progress-flush", daemon=True)
                self._thread.start()

    def flush(self) -> None:
        """Write every queued line now, in one append."""
        with self._lock:
            data, self._pending = "".join(self._pending), []
            if not data:
                return
            # Under the lock, so two flushes cannot interleave their lines.
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                _append(self.path, data.encode())
            except OSError:
                self._pending.insert(0, data)  # keep the lines for the next flush
                raise

    def close(self) -> None:
        """Stop the thread and write what is left. Safe to call twice."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.flush()
            except OSError:  # a full or vanished disk must not kill training; the next flush retries
                log.warning("could not append to %s", self.path, exc_info=True)


def _append(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
