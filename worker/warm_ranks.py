"""`python -m worker.warm_ranks <spec.json>`: a warm parent for one job's ranks on one node.

It applies the job's environment (worker.launch.apply_env), imports torch and the worker once, and
then forks each rank the supervisor asks for: a rank started so skips the second or two that importing
torch takes, and a restart in place only forks. Nothing is initialised before a fork but what importing
does (no CUDA, no thread pool, no process group), and the child becomes exactly what
`python -m worker.rank_main` would be: its own rank variables, its log files on fds 1 and 2, nothing
on fd 0, the same sys.argv, then worker.rank_main.main and an interpreter's exit.

Locally the supervisor starts one (worker.run_local); on SLURM one srun step runs one on every node of
the allocation, spares included (worker.run_slurm), srun passing the supervisor's lines to all of them
and theirs back. The protocol is JSON lines, each naming the node it is for or from ("host": SLURM's
node name; null locally); a parent takes only the requests for its own node:
- in: {"host", "rank", "env", "out", "err", "spec"}: fork a rank; {"host", "pid", "signal"}: signal one;
- out: {"host", "task", "ready"} once torch is imported; {"host", "rank", "pid"} when a rank is forked;
  {"host", "pid", "code"} when it has ended (`code` as subprocess reports it: negative for a signal).
A parent ends when its stdin closes (the supervisor is done) or when it cannot import the worker: the
supervisor then starts ranks cold, and their own error files say why.

This process is the job's, run as its account: what it reads on stdin comes from the supervisor.
The supervisor's end of it is WarmParent (torch-free: this module imports torch only in main()).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, Protocol

POLL_S = 0.02  # how often children that ended are reaped between requests
FORK_ANSWER_S = 10.0  # a fork is answered in milliseconds; past this the parent is taken as stuck
HOST = os.environ.get("SLURMD_NODENAME")  # this parent's node on SLURM; None on the local backend
# srun's report of a parent that ended (its node lost, say): `srun: error: n2: task 1: Killed`.
_TASK_ENDED = re.compile(r"task (\d+): (Killed|Exited with exit code \d+|Terminated)")


class RankProcess(Protocol):
    """A rank's process as the supervisor watches it: a cold one's Popen or a forked one's WarmRank."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...


class WarmParent:
    """The supervisor's end of a job's warm parents (one locally, one a node in an srun step): starts
    them, asks them for ranks, hears how the ranks end, and which parents are gone."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None, *, via_srun: bool = False) -> None:
        # cwd "/", as a cold rank's: `-m` puts the working folder first on sys.path.
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd="/",
                                        stderr=subprocess.PIPE if via_srun else None)
        self.changed = threading.Condition()
        self.ready: set[str | None] = set()
        self.task_host: dict[int, str | None] = {}  # srun's task number -> the node it runs on
        self.lost: set[str | None] = set()  # nodes whose parent is gone
        self.gone = False  # all of them (the process, or srun, ended)
        self.forked: dict[str | None, list[int]] = {}  # pids answered to fork requests, not yet taken
        self.codes: dict[tuple[str | None, int], int] = {}  # (node, pid) -> how it ended
        threading.Thread(target=self._listen, name="torchyard-warm-parent", daemon=True).start()
        if via_srun:
            threading.Thread(target=self._srun_words, name="torchyard-warm-srun", daemon=True).start()

    def _listen(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                message = json.loads(line)
            except ValueError:  # not ours: a word srun or the interpreter wrote on stdout
                continue
            host = message.get("host")
            with self.changed:
                if "ready" in message:
                    self.ready.add(host)
                    self.task_host[int(message.get("task") or 0)] = host
                elif "code" in message:
                    self.codes[(host, int(message["pid"]))] = int(message["code"])
                else:
                    self.forked.setdefault(host, []).append(int(message["pid"]))
                self.changed.notify_all()
        with self.changed:
            self.gone = True
            self.changed.notify_all()

    def _srun_words(self) -> None:
        """srun's stderr, passed on to the supervisor's; a parent it says ended is a node lost."""
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip()
            print(line, file=sys.stderr, flush=True)
            match = _TASK_ENDED.search(line)
            if match:
                with self.changed:
                    if int(match.group(1)) in self.task_host:
                        self.lost.add(self.task_host[int(match.group(1))])
                    self.changed.notify_all()

    def wait_ready(self, hosts: Collection[str | None], timeout: float) -> set[str | None]:
        """The parents of `hosts` that imported the worker within `timeout` seconds; none left
        running when there are none."""
        with self.changed:
            self.changed.wait_for(lambda: self.gone or set(hosts) <= self.ready - self.lost, timeout)
            ready = set(hosts) & (self.ready - self.lost) if not self.gone else set()
        if not ready:
            self.process.kill()
        return ready

    def usable(self, hosts: Iterable[str | None]) -> bool:
        """Whether every one of `hosts` has a parent ready to fork."""
        with self.changed:
            return not self.gone and all(host in self.ready and host not in self.lost for host in hosts)

    def mark_lost(self, host: str | None) -> None:
        """The node is gone from the allocation: its ranks are lost, nothing will say how they ended."""
        with self.changed:
            self.lost.add(host)
            self.changed.notify_all()

    def fork(self, rank: int, env: dict[str, str], out: Path, err: Path, spec_path: Path,
             host: str | None = None) -> WarmRank | None:
        """A rank forked on `host` with these variables and logs; None when its parent is gone."""
        request = {"host": host, "rank": rank, "env": env, "out": str(out), "err": str(err),
                   "spec": str(spec_path)}
        if not self._send(request):
            return None
        with self.changed:
            self.changed.wait_for(lambda: bool(self.forked.get(host)) or self.gone or host in self.lost,
                                  FORK_ANSWER_S)
            if self.forked.get(host):
                return WarmRank(self, host, self.forked[host].pop(0))
            self.lost.add(host)  # stuck, or gone: a late answer must not be taken for the next request's
        return None

    def signal(self, host: str | None, pid: int, signum: int) -> None:
        if host is None:  # this machine's: at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        else:
            self._send({"host": host, "pid": pid, "signal": signum})

    def _send(self, message: dict[str, Any]) -> bool:
        assert self.process.stdin is not None
        try:
            self.process.stdin.write((json.dumps(message) + "\n").encode())
            self.process.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def code(self, host: str | None, pid: int) -> int | None:
        """How the child `pid` on `host` ended, or None while it runs. A child whose parent is gone
        before telling is taken as killed when it is no longer there (here), or always (on a node:
        nothing else can tell how it ended, and its node is lost or its step ended)."""
        with self.changed:
            if (host, pid) in self.codes:
                return self.codes[(host, pid)]
            if host is not None and (host in self.lost or self.gone):
                return -signal.SIGKILL
            if not self.gone and host not in self.lost:
                return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return -signal.SIGKILL
        return None

    def close(self) -> None:
        """No more ranks: the parents leave once theirs have ended (an srun step, with them)."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.process.stdin.close()


class WarmRank:
    """A forked rank, watched through its warm parent (it is the parent's child, not ours)."""

    def __init__(self, parent: WarmParent, host: str | None, pid: int) -> None:
        self.parent = parent
        self.host = host
        self._pid = pid

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        return self.parent.code(self.host, self._pid)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"rank pid {self._pid}", timeout or 0.0)
            time.sleep(POLL_S)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            self.parent.signal(self.host, self._pid, signum)


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
    say({"ready": True, "task": int(os.environ.get("SLURM_PROCID") or 0)})
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
                if request.get("host") != HOST:
                    continue  # another node's (srun gives every node's parent every line)
                if "signal" in request:
                    if int(request["pid"]) in children:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(int(request["pid"]), int(request["signal"]))
                    continue
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


def say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps({"host": HOST, **message}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
