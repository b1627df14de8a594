"""`python -m worker.warm_ranks <spec.json>`: a warm parent for one job's ranks on this machine.

It applies the job's environment (worker.launch.apply_env), imports torch and the worker once, and
then forks each rank the supervisor asks for (worker.run_local): a rank started so skips the second
or two that importing torch takes, and a restart in place only forks. Nothing is initialised before
a fork but what importing does (no CUDA, no thread pool, no process group), and the child becomes
exactly what `python -m worker.rank_main` would be: its own rank variables, its log files on fds 1
and 2, nothing on fd 0, the same sys.argv, then worker.rank_main.main and an interpreter's exit.

The protocol is JSON lines. On stdin, one per rank to fork: {"rank", "env", "out", "err", "spec"}.
On stdout: {"rank", "pid"} when it is forked, {"pid", "code"} when it has ended (`code` as
subprocess reports it: negative for a signal). "ready" comes first, once torch is imported. It ends
when stdin closes (the supervisor is done with it) or when it cannot import the worker: the
supervisor then starts ranks cold, and their own error files say why.

This process is the job's, run as its account: what it reads on stdin comes from the supervisor.
The supervisor's end of it is WarmParent (torch-free: this module imports torch only in main()).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Protocol

READY = "ready"
POLL_S = 0.02  # how often children that ended are reaped between requests
FORK_ANSWER_S = 10.0  # a fork is answered in milliseconds; past this the parent is taken as stuck


class RankProcess(Protocol):
    """A rank's process as the supervisor watches it: a cold one's Popen or a forked one's WarmRank."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...


class WarmParent:
    """The supervisor's end of a job's warm parent: starts it, asks it for ranks, hears how they end."""

    def __init__(self, spec_path: Path) -> None:
        # cwd "/", as a cold rank's: `-m` puts the working folder first on sys.path.
        self.process = subprocess.Popen([sys.executable, "-u", "-m", "worker.warm_ranks", str(spec_path)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd="/")
        self.changed = threading.Condition()
        self.ready = False
        self.gone = False
        self.forked: list[int] = []  # pids answered to fork requests, in order, not yet taken
        self.codes: dict[int, int] = {}  # pid -> how it ended
        threading.Thread(target=self._listen, name="torchyard-warm-parent", daemon=True).start()

    def _listen(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            message = json.loads(line)
            with self.changed:
                if message == READY:
                    self.ready = True
                elif "code" in message:
                    self.codes[int(message["pid"])] = int(message["code"])
                else:
                    self.forked.append(int(message["pid"]))
                self.changed.notify_all()
        with self.changed:
            self.gone = True
            self.changed.notify_all()

    def wait_ready(self, timeout: float) -> bool:
        """Whether it imported the worker within `timeout` seconds (else it is ended)."""
        with self.changed:
            self.changed.wait_for(lambda: self.ready or self.gone, timeout)
            if self.ready and not self.gone:
                return True
        self.process.kill()
        return False

    def alive(self) -> bool:
        with self.changed:
            return not self.gone

    def fork(self, rank: int, env: dict[str, str], out: Path, err: Path, spec_path: Path) -> WarmRank | None:
        """A rank forked with these variables and logs; None when the parent is gone."""
        request = {"rank": rank, "env": env, "out": str(out), "err": str(err), "spec": str(spec_path)}
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            self.process.stdin.flush()
        except OSError:
            return None
        with self.changed:
            self.changed.wait_for(lambda: bool(self.forked) or self.gone, FORK_ANSWER_S)
            if self.forked:
                return WarmRank(self, self.forked.pop(0))
        self.process.kill()  # stuck, or gone: a late answer must not be taken for the next request's
        return None

    def code(self, pid: int) -> int | None:
        """How the child `pid` ended, or None while it runs. Were the parent gone before telling, a
        child no longer there is taken as killed: nothing else can tell how it ended."""
        with self.changed:
            if pid in self.codes:
                return self.codes[pid]
            if not self.gone:
                return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -signal.SIGKILL
        return None


class WarmRank:
    """A forked rank, watched through its warm parent (it is the parent's child, not ours)."""

    def __init__(self, parent: WarmParent, pid: int) -> None:
        self.parent = parent
        self._pid = pid

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        return self.parent.code(self._pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self._pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signum)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m worker.warm_ranks <spec.json>", file=sys.stderr)
        return 2
    from worker.launch import apply_env
    from worker.spec import RunSpec

    # A cancel (SIGINT to the job's process group) is for the ranks; this parent leaves when the
    # supervisor does (its stdin closes), after reporting how each rank ended.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    apply_env(RunSpec.model_validate_json(Path(argv[0]).read_text(encoding="utf-8")))
    try:
        import worker.runner  # noqa: F401  torch arrives here, after the job's environment
    except ImportError:
        return 1  # the ranks start cold and say why in their error files
    with contextlib.suppress(ImportError):
        # What a rank's first optimizer imports (torch.optim reaches torch._dynamo, ~800 modules): a
        # second a rank, paid here once. An import only: no thread, no kernel, nothing to fork unsafely.
        import torch._dynamo  # noqa: F401
    say(READY)
    serve()
    return 0


def serve() -> None:
    """Fork a rank per request line; report each child's end; return when stdin closes.

    stdin is read with os.read, not through sys.stdin: a buffered reader may hold a request that
    select() no longer sees, and a child would inherit what it held."""
    children: set[int] = set()
    pending = b""
    stdin_open = True
    while stdin_open or children:
        readable, _, _ = select.select([0], [], [], POLL_S) if stdin_open else ([], [], [])
        if readable:
            chunk = os.read(0, 65536)
            stdin_open = bool(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                request = json.loads(line)
                children.add(pid := fork_rank(request))
                say({"rank": request["rank"], "pid": pid})
        elif not stdin_open:
            time.sleep(POLL_S)
        for pid in reap(children):
            children.discard(pid)


def reap(children: set[int]) -> list[int]:
    """The children that ended, each reported with its status."""
    ended = []
    for pid in list(children):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            say({"pid": pid, "code": os.waitstatus_to_exitcode(status)})
            ended.append(pid)
    return ended


def fork_rank(request: dict[str, Any]) -> int:
    """Fork one rank; in the child, run it to its end and leave as an interpreter would."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        become_rank(request)
        from worker.rank_main import main as rank_main

        code = rank_main([request["spec"]])
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(leave(code))


def become_rank(request: dict[str, Any]) -> None:
    """What a cold start would have given this rank: its variables, logs, no stdin, argv."""
    signal.signal(signal.SIGINT, signal.default_int_handler)  # a cancel, as in a cold rank
    os.environ.update({str(name): str(value) for name, value in request["env"].items()})
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT),
                            (2, request["err"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115  the process's stdin from now on
    import worker.rank_main

    sys.argv = [str(worker.rank_main.__file__), request["spec"]]


def leave(code: int) -> int:
    """An interpreter's exit without returning into the parent's loop: the job's threads joined, its
    atexit functions run, the streams flushed; `code` unless one of those raised SystemExit."""
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    return code


def say(message: object) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
