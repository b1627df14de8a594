"""The programs the service runs: its own, found once on its own PATH and run by absolute path, and
programs someone else controls, run bounded in time and in what is read of their output.

The service's own programs (setpriv, sbatch, squeue, sacct, scancel, scontrol): a bare name is looked
up on the PATH of the environment the process is *given*, and the service gives jobs' processes the
job's environment, whose PATH starts with the folder of the job's interpreter: a folder its user may
own. A `setpriv` planted there would run as root. So no command line of the service names a program
by its bare name: it asks `program`, where the name is resolved on the PATH the service started
with, once, and the answer is an absolute path that no later environment changes.

A program someone else controls (`run_bounded`): subprocess.run(capture_output=True) keeps everything
a program prints, and on a timeout kills the program but not what it started. A user's interpreter,
which admission asks what it has (service.domain.policy), is such a program: it runs as the user's
account, and its sitecustomize or .pth files could print gigabytes into the service's memory or leave
processes behind. There each stream is read up to a bound, the program runs in a process group of
its own, and past the bound or the deadline the whole group is killed and nothing more is read.
"""

from __future__ import annotations

import contextlib
import functools
import os
import selectors
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

REAP_S = 5.0  # how long a killed program is waited for (one stuck on a hung mount is left behind)
_CHUNK = 65536


class OutputTooLong(Exception):
    """The program printed more than it may on `stream`; it has been killed."""

    def __init__(self, stream: str, most_bytes: int) -> None:
        super().__init__(f"more than {most_bytes} bytes on {stream}")
        self.stream = stream
        self.most_bytes = most_bytes


@dataclass(frozen=True)
class Finished:
    returncode: int
    stdout: str  # decoded as UTF-8, anything else replaced
    stderr: str


MOST_INPUT_BYTES = 16384  # input is written whole before any output is read: less than a pipe holds


def run_bounded(
    command: Sequence[str],
    *,
    timeout_s: float,
    most_bytes: int,
    env: Mapping[str, str],
    cwd: str,
    input_bytes: bytes | None = None,
) -> Finished:
    """Run `command` with no input (or `input_bytes`, at most MOST_INPUT_BYTES) and wait for it.
    OSError when it cannot start; subprocess.TimeoutExpired past `timeout_s`; OutputTooLong when it
    prints more than `most_bytes` on stdout or on stderr. In the last two cases it, and all it
    started in its group, is killed."""
    process = subprocess.Popen(
        list(command),
        stdin=subprocess.DEVNULL if input_bytes is None else subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,  # its own process group: killed whole, children included
    )
    deadline = time.monotonic() + timeout_s
    try:
        if input_bytes is not None:
            _feed(process, input_bytes)
        out, err = _read_both(process, deadline, most_bytes, command, timeout_s)
        returncode = process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except BaseException:
        _kill_group(process)
        raise
    finally:
        for pipe in (process.stdout, process.stderr):
            if pipe is not None:
                pipe.close()
    return Finished(returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))


def _feed(process: subprocess.Popen[bytes], input_bytes: bytes) -> None:
    """Write all of the input and close it: it fits in the pipe, so this never waits on the program
    (one that exits without reading it is no error: its answer says what it made of that)."""
    if len(input_bytes) > MOST_INPUT_BYTES:
        raise ValueError(f"at most {MOST_INPUT_BYTES} bytes of input")
    assert process.stdin is not None
    with contextlib.suppress(BrokenPipeError):
        process.stdin.write(input_bytes)
    with contextlib.suppress(BrokenPipeError):
        process.stdin.close()


def _read_both(
    process: subprocess.Popen[bytes],
    deadline: float,
    most_bytes: int,
    command: Sequence[str],
    timeout_s: float,
) -> tuple[bytes, bytes]:
    """Both streams to their end, each at most `most_bytes`, before `deadline`."""
    assert process.stdout is not None and process.stderr is not None
    read: dict[int, bytearray] = {process.stdout.fileno(): bytearray(), process.stderr.fileno(): bytearray()}
    names = {process.stdout.fileno(): "stdout", process.stderr.fileno(): "stderr"}
    with selectors.DefaultSelector() as selector:
        for pipe in (process.stdout, process.stderr):
            selector.register(pipe, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(list(command), timeout_s)
            for key, _ in selector.select(left):
                kept = read[key.fd]
                chunk = os.read(key.fd, min(_CHUNK, most_bytes + 1 - len(kept)))
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                kept += chunk
                if len(kept) > most_bytes:
                    raise OutputTooLong(names[key.fd], most_bytes)
    return bytes(read[process.stdout.fileno()]), bytes(read[process.stderr.fileno()])


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """Kill the program's process group. The program is not reaped before this (its id, which names
    the group, cannot have been reused), and is waited for only a while after."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=REAP_S)


class ProgramMissing(FileNotFoundError):
    """The program is not on the service's PATH (an OSError, as a failed exec is)."""


@functools.cache
def program(name: str) -> str:
    """The absolute path of `name` on the service's own PATH (its process environment, never a job's),
    looked up at the first call; ProgramMissing when there is none (asked again at the next call)."""
    path = os.environ.get("PATH", os.defpath)
    found = shutil.which(name, path=path)
    if found is None:
        raise ProgramMissing(f"'{name}' is not on the service's PATH ({path})")
    return os.path.abspath(found)
