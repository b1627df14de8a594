"""Every rank's stack on demand, without attaching to it, and what its main thread is doing.

- faulthandler, registered on SIGURG (install_stack_dumps): when the service signals the job's
  processes, each rank's handler (C, run in the signal handler, needing neither the GIL nor the rank's
  own Python thread) appends every thread's Python stack to the rank's stacks file
  (JobFiles.stacks). It answers from a rank stuck in C code that holds the GIL (a catastrophic regex)
  and from a rank blocked in a collective. SIGURG's default action is to ignore it, so a process of
  the job without the handler (a helper it started) is not hurt; a child forked by the rank (a
  DataLoader worker) drops the handler, so its stacks do not interleave with the rank's.
- an activity thread (ActivitySampler) rewrites the rank's activity file (JobFiles.activity) every
  ACTIVITY_INTERVAL_S: where the main thread is in the job's own code, and when its stack last changed.
  A rank whose Python cannot run stops rewriting it, and its `time` goes stale.
- NCCL's flight recorder (flight_recorder_env): an NCCL rank keeps a bounded trace of its collectives
  and dumps it beside the stacks on a collective's timeout.

Torch-free: imported by worker.launch before the rank's torch.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import logging
import os
import signal
import sys
import sysconfig
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path
from types import FrameType
from typing import BinaryIO

from worker.spec import ACTIVITY_INTERVAL_S, JobFiles

log = logging.getLogger(__name__)

STACK_SIGNAL = signal.SIGURG  # the service's signal for "append your stacks"
CAPTURE_POLL_S = 0.5  # how soon after a capture an NCCL rank's flight recorder is dumped
MAX_SAMPLED_FRAMES = 256  # of the main thread's stack, innermost first, compared between samples
NCCL_TRACE_ENTRIES = "2000"  # the flight recorder's ring buffer: collectives kept per rank
# (variable, its newer alias in PyTorch): a rank's user setting of either one is kept as it is.
NCCL_TRACE_BUFFER = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")
NCCL_DUMP_FILE = ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")
NCCL_DUMP_ON_TIMEOUT = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)

_installed: dict[str, object] = {}  # what must live as long as the process: the stacks file, the thread


def install_stack_dumps(files: JobFiles, rank: int, attempt: int, host: str, *,
                        interval_s: float = ACTIVITY_INTERVAL_S) -> None:
    """Before the rank's entrypoint runs: SIGURG appends every thread's stack to the rank's stacks
    file, and an activity thread rewrites its activity file every `interval_s`. Never raises: a rank
    that cannot be watched still trains (the reason is logged)."""
    try:
        register_stack_dump(files.stacks(rank))
    except (OSError, RuntimeError, ValueError):
        log.warning("stacks on SIGURG are off for this rank", exc_info=True)
    sampler = _installed.get("sampler")
    if isinstance(sampler, ActivitySampler):
        sampler.stop()
    sampler = ActivitySampler(files.activity(rank), attempt=attempt, rank=rank, host=host,
                              interval_s=interval_s)  # fmt: skip
    try:
        sampler.start()
    except (OSError, RuntimeError):  # no activity folder, or no thread to be had
        log.warning("the activity file is off for this rank", exc_info=True)
        return
    _installed["sampler"] = sampler


def register_stack_dump(path: Path) -> None:
    """faulthandler on STACK_SIGNAL, appending all threads' stacks to `path` (made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out: BinaryIO = open(path, "ab", buffering=0)  # noqa: SIM115 (kept open for the process's life)
    try:
        faulthandler.register(STACK_SIGNAL, file=out, all_threads=True, chain=False)
    except BaseException:
        out.close()
        raise
    previous = _installed.get("stacks_file")
    _installed["stacks_file"] = out  # faulthandler writes to its descriptor: keep it open
    if hasattr(previous, "close"):
        previous.close()
    if not _installed.get("fork_hook"):
        os.register_at_fork(after_in_child=_forget_in_child)
        _installed["fork_hook"] = True


def uninstall_stack_dumps() -> None:
    """Undo install_stack_dumps in this process (tests that run a launcher in their own process)."""
    sampler = _installed.pop("sampler", None)
    if isinstance(sampler, ActivitySampler):
        sampler.stop()
    with contextlib.suppress(RuntimeError, ValueError):
        faulthandler.unregister(STACK_SIGNAL)
    out = _installed.pop("stacks_file", None)
    if hasattr(out, "close"):
        out.close()


def _forget_in_child() -> None:
    """In a forked child (a DataLoader worker): no stacks on SIGURG (its default, ignore, returns),
    so the rank's file holds the rank's stacks alone."""
    with contextlib.suppress(RuntimeError, ValueError):
        faulthandler.unregister(STACK_SIGNAL)
    _installed.pop("sampler", None)  # its thread did not come along


def flight_recorder_env(files: JobFiles, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Turn NCCL's flight recorder on for an NCCL rank, where the user did not set it: a bounded trace
    buffer, a dump on a collective's timeout into the job's stacks folder (PyTorch appends the rank).
    Returns what was set. Call before the process group is made (before torch, to be safe)."""
    chosen = {
        NCCL_TRACE_BUFFER: NCCL_TRACE_ENTRIES,
        NCCL_DUMP_FILE: str(files.flight_recorder_prefix),
        NCCL_DUMP_ON_TIMEOUT: "1",
    }
    set_now: dict[str, str] = {}
    for names, value in chosen.items():
        if not any(name in environ for name in names):
            environ[names[0]] = set_now[names[0]] = value
    if set_now:
        files.flight_recorder_prefix.parent.mkdir(parents=True, exist_ok=True)
    return set_now


def dump_flight_recorder_on_capture(files: JobFiles, rank: int) -> None:
    """An NCCL rank's flight recorder dumped to JobFiles.flight_recorder(rank) after each capture
    of its stacks (soon after SIGURG, by the activity thread), so the service reads it with them."""
    sampler, stacks = _installed.get("sampler"), _installed.get("stacks_file")
    if isinstance(sampler, ActivitySampler) and isinstance(stacks, io.FileIO):
        path = files.flight_recorder(rank)
        sampler.watch_captures(stacks, lambda: dump_flight_recorder(path))


def dump_flight_recorder(path: Path) -> bool:
    """NCCL's flight recorder of this process, written to `path` whole (PyTorch's pickle); False when
    there is none to dump (torch.distributed not up, or not NCCL). Never imports torch: a rank that
    did not import it has none. Safe from any thread (PyTorch's own watchdog dumps from one)."""
    dist = sys.modules.get("torch.distributed")
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if dist is None or c10d is None or not dist.is_available() or not dist.is_initialized():
        return False
    dump = getattr(c10d, "_dump_nccl_trace", None)
    if dump is None or str(dist.get_backend()) != "nccl":
        return False
    try:
        data = dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)
    except TypeError:  # an older PyTorch: positional, or none
        data = dump()
    if not isinstance(data, bytes):
        return False
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temp.write_bytes(data)
    os.replace(temp, path)
    return True


# ------------------------------------------------------------------------------------ activity


def library_folders() -> tuple[str, ...]:
    """Folders whose code is not the job's own: the interpreter's library, installed packages, and
    torchyard's worker (its tasks/, our demonstrations, count as a job's)."""
    paths = sysconfig.get_paths()
    found = {paths[key] for key in ("stdlib", "platstdlib", "purelib", "platlib") if key in paths}
    found.add(os.path.dirname(os.path.abspath(__file__)))
    return tuple(sorted(folder.rstrip(os.sep) + os.sep for folder in found))


def is_own_code(filename: str, library: tuple[str, ...]) -> bool:
    """Whether `filename` (a code object's) is the job's own code rather than a library's."""
    if filename.startswith("<"):  # <frozen ...>, <string>
        return False
    if os.sep + "worker" + os.sep + "tasks" + os.sep in filename:
        return True
    return not filename.startswith(library)


def main_stack(frame: FrameType | None) -> list[tuple[str, int, str]]:
    """(file, line, function) of `frame` and its callers, innermost first (at most MAX_SAMPLED_FRAMES)."""
    stack: list[tuple[str, int, str]] = []
    while frame is not None and len(stack) < MAX_SAMPLED_FRAMES:
        code = frame.f_code
        stack.append((code.co_filename, frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    return stack


def where_in(stack: list[tuple[str, int, str]], library: tuple[str, ...]) -> str | None:
    """The innermost frame of the job's own code as "file:line function" (else the innermost one)."""
    for filename, line, function in stack:
        if is_own_code(filename, library):
            return f"{filename}:{line} {function}"
    if stack:
        filename, line, function = stack[0]
        return f"{filename}:{line} {function}"
    return None


# Of a core, between two samples: the main thread is working, not waiting. Low, because a working rank
# on an oversubscribed node gets only its share of a core (a tenth, with ten busy threads a core),
# while a rank that waits (a sleep, a collective whose peer is missing) spends next to nothing.
BUSY_SHARE = 0.03


def _cpu_clock_of(thread_ident: int | None) -> int | None:
    """The CPU-time clock of a thread (its ident is its pthread id on POSIX); None where there is none."""
    if thread_ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return None
    try:
        return time.pthread_getcpuclockid(thread_ident)
    except (OSError, OverflowError, ValueError):
        return None


class ActivitySampler:
    """A daemon thread that samples the main thread's stack every `interval_s` and rewrites the
    rank's activity file atomically: {"attempt", "rank", "host", "pid", "time", "changed_at", "where"}.

    A sample costs one sys._current_frames() and a walk of the main thread's frames: at 5 s, nothing
    a training loop can measure."""

    def __init__(self, path: Path, *, attempt: int, rank: int, host: str,
                 interval_s: float = ACTIVITY_INTERVAL_S, main_ident: int | None = None) -> None:
        self.path = path
        self.record: dict[str, object] = {"attempt": attempt, "rank": rank, "host": host, "pid": os.getpid()}
        self.interval_s = interval_s
        self.main_ident = threading.main_thread().ident if main_ident is None else main_ident
        self.library = library_folders()
        self._last: list[tuple[str, int, str]] | None = None
        self._changed_at = time.time()
        self._cpu_clock = _cpu_clock_of(self.main_ident)
        self._cpu_seen: tuple[float, float] | None = None  # (time, the main thread's CPU seconds)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # After a capture (the stacks file grew): on_capture() (NCCL's flight recorder dumped), looked
        # for every CAPTURE_POLL_S; none by default, and then the thread wakes only to sample.
        self.on_capture: Callable[[], object] | None = None
        self.watched: BinaryIO | None = None
        self._watched_size = -1

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.sample()  # the file stands from the rank's start
        self._thread = threading.Thread(target=self._run, name="torchyard-activity", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def sample(self, now: float | None = None) -> dict[str, object]:
        """Look at the main thread once and rewrite the file; returns what was written."""
        now = time.time() if now is None else now
        frame = sys._current_frames().get(self.main_ident) if self.main_ident is not None else None
        stack = main_stack(frame)
        del frame
        worked = self._main_thread_worked(now)  # every sample: the next one measures from this one
        if stack != self._last or worked:
            self._last, self._changed_at = stack, now
        record = {**self.record, "time": now, "changed_at": self._changed_at,
                  "where": where_in(stack, self.library)}  # fmt: skip
        try:
            _replace_text(self.path, json.dumps(record) + "\n")
        except FileNotFoundError:  # the job's folder went (the job is over): nothing more to say
            self.stop()
        except OSError:  # a full disk must not stop training; the next sample retries
            log.debug("could not write %s", self.path, exc_info=True)
        return record

    def _main_thread_worked(self, now: float) -> bool:
        """Whether the main thread spent BUSY_SHARE of a core since the last sample: a rank inside one
        long C call (a big backward) shows the same stack sample after sample, yet it moves; a rank
        that waits (a sleep, a collective whose peer is missing) spends next to nothing."""
        if self._cpu_clock is None:
            return False
        try:
            cpu = time.clock_gettime(self._cpu_clock)
        except OSError:  # the thread is gone
            return False
        seen, self._cpu_seen = self._cpu_seen, (now, cpu)
        return seen is not None and cpu - seen[1] >= BUSY_SHARE * max(now - seen[0], 1e-3)

    def watch_captures(self, stacks: BinaryIO, on_capture: Callable[[], object]) -> None:
        """Call `on_capture` (in this thread) soon after `stacks` (faulthandler's file) grows."""
        self._watched_size = _size(stacks)
        self.watched, self.on_capture = stacks, on_capture

    def _run(self) -> None:
        next_sample = time.monotonic() + self.interval_s
        while True:
            wait = next_sample - time.monotonic()
            if self.on_capture is not None:
                wait = min(wait, CAPTURE_POLL_S)
            if self._stop.wait(max(wait, 0.0)):
                return
            self._after_capture()
            if time.monotonic() >= next_sample:
                self.sample()
                next_sample = time.monotonic() + self.interval_s

    def _after_capture(self) -> None:
        if self.on_capture is None or self.watched is None:
            return
        size = _size(self.watched)
        if size > self._watched_size >= 0:
            try:
                self.on_capture()
            except Exception:  # a failed dump costs the dump, never the rank
                log.warning("after a stacks capture", exc_info=True)
        self._watched_size = size


def _size(out: BinaryIO) -> int:
    try:
        return os.fstat(out.fileno()).st_size
    except (OSError, ValueError):  # closed
        return -1


def _replace_text(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step (a reader sees the old file or the new one whole); no
    fsync: the file only matters while the rank lives, and a sync every few seconds costs on NFS."""
    temp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(temp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(temp, path)
