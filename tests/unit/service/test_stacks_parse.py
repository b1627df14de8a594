"""service.domain.stacks: faulthandler's text as real processes write it (threads, deep recursion, three
gloo ranks, one of them apart), and as a hostile job might (huge, binary, NUL, surrogates, endless
threads); grouping, rank lists and the one-line summary."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from service.domain.stacks import (
    MAX_FRAMES,
    MAX_NAME_CHARS,
    MAX_THREADS,
    Frame,
    RankStacks,
    ThreadStack,
    collective_of,
    format_ranks,
    group_ranks,
    is_own_code,
    main_thread,
    parse_faulthandler,
    place_of,
    summarize,
)
from tests.support import ROOT


def dump_of(tmp_path: Path, body: str, timeout_s: float = 60) -> tuple[str, Path]:
    """faulthandler's text for all threads of a process running `body`, which calls dump() where
    it wants its stacks taken (written to stdout, as a rank's handler writes its file)."""
    script = tmp_path / "job.py"
    script.write_text("import faulthandler, sys, threading, time\n"
                      "def dump():\n    faulthandler.dump_traceback(all_threads=True)\n"
                      + textwrap.dedent(body))  # fmt: skip
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout_s,
                          check=True)  # fmt: skip
    return done.stderr, script


def test_real_threads_parse_with_the_main_thread_last(tmp_path: Path) -> None:
    text, script = dump_of(tmp_path, """\
        ready = threading.Event()
        def loader():
            ready.set(); time.sleep(30)
        threading.Thread(target=loader, daemon=True).start()
        ready.wait(); time.sleep(0.1)
        def next_batch():
            dump()
        next_batch()
        """)
    threads = parse_faulthandler(text)
    assert len(threads) == 2 and [t.current for t in threads] == [False, True]
    assert threads[0].name.startswith("0x") and threads[0].frames[0].function == "loader"
    main = main_thread(threads)
    assert main is threads[-1] and main is not None
    assert [(f.file, f.function) for f in main.frames] == [
        (str(script), "dump"), (str(script), "next_batch"), (str(script), "<module>")]
    assert main.frames[1].line == 10 and main.frames[1].short == "job.py:10 next_batch"
    assert place_of(threads) == "in job.py:3 dump"  # the innermost frame of the job's own code


def test_deep_recursion_keeps_the_first_hundred_frames(tmp_path: Path) -> None:
    text, _ = dump_of(tmp_path, """\
        def down(n):
            return dump() if n == 0 else down(n - 1)
        down(500)
        """)
    (main,) = parse_faulthandler(text)
    assert len(main.frames) == MAX_FRAMES and main.truncated  # faulthandler wrote 100 and "..."
    assert main.frames[0].function == "dump" and main.frames[1].function == "down"


def test_a_second_dump_in_the_same_text_is_ignored() -> None:
    one = 'Thread 0x0000000000000001 (most recent call first):\n  File "a.py", line 1 in f\n\n'
    two = 'Current thread 0x0000000000000002 (most recent call first):\n  File "a.py", line 2 in g\n'
    threads = parse_faulthandler(one + two + one.replace("line 1", "line 9") + two)
    assert [t.frames[0].line for t in threads] == [1, 2]


def test_named_threads_single_stacks_and_unknown_lines() -> None:
    text = ("Current thread 0x00007f5b3744cb80 [python3] (most recent call first):\n"
            '  File "/j/t.py", line ??? in <lambda>\n  <no Python frame>\n  garbage\n'
            '  File "/j/t.py", line 12 in run\n')  # fmt: skip
    (thread,) = parse_faulthandler(text)
    assert thread.name == "0x00007f5b3744cb80 [python3]" and thread.current
    assert [(f.line, f.function) for f in thread.frames] == [(0, "<lambda>"), (12, "run")]
    (single,) = parse_faulthandler('Stack (most recent call first):\n  File "x.py", line 3 in f\n')
    assert single.name == "main" and single.frames == [Frame(file="x.py", line=3, function="f")]


@pytest.mark.parametrize("text", [
    "", "\n\n", os.urandom(65536).decode("utf-8", errors="replace"), "\x00" * 100000,
    "Thread 0xzz (most recent call first):\n", '  File "x.py", line 3 in f\n' * 1000,  # frames, no thread
    "Thread 0x1 (most recent call first):\n" + '  File "x.py", line 99999999999999999999 in f\n',
])
def test_garbage_gives_nothing_or_what_is_usable(text: str) -> None:
    threads = parse_faulthandler(text)
    assert len(threads) <= 1 and all(frame.line >= 0 for t in threads for frame in t.frames)


def test_hostile_text_is_bounded_and_cleaned() -> None:
    frames = '  File "x.py", line 7 in f\n' * 300
    many = "".join(f"Thread 0x{n:016x} (most recent call first):\n{frames}" for n in range(1000))  # 8 MB
    started = time.monotonic()
    threads = parse_faulthandler(many)
    assert time.monotonic() - started < 2.0
    assert len(threads) == MAX_THREADS and all(len(t.frames) == MAX_FRAMES and t.truncated for t in threads)
    evil = "x\x00\ud800" + "y" * 100000
    header = "Thread 0x1 (most recent call first):\n"
    (thread,) = parse_faulthandler(f'{header}  File "{evil}.py", line 7 in {evil}\n')
    name = thread.frames[0].function
    assert len(name) == MAX_NAME_CHARS and "\x00" not in name and "\ufffd" in name
    assert len(thread.frames[0].file) == MAX_NAME_CHARS


def stacks(rank: int, *frames: tuple[str, int, str], host: str = "n1") -> RankStacks:
    main = ThreadStack(name="0x1", frames=[Frame(file=f, line=n, function=fn) for f, n, fn in frames])
    waiting = Frame(file="/usr/lib/python3.11/threading.py", line=1, function="wait")
    helper = ThreadStack(name="0x2", frames=[waiting])
    return RankStacks(rank=rank, host=host, captured_at=1.0, threads=[helper, main])


ALL_REDUCE = (
    ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2800, "all_reduce"),
    ("/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", 81, "wrapper"),
    ("/job/code/train.py", 88, "step"),
    ("/job/code/train.py", 120, "main"),
)


def test_the_odd_rank_is_named_first_with_its_host_and_the_others_wait_in_a_collective() -> None:
    ranks = [stacks(r, *ALL_REDUCE) for r in (0, 2, 3, 4, 5, 6, 7)]
    ranks.append(stacks(1, ("/job/code/loader.py", 41, "next_batch"), ("/job/code/train.py", 87, "step"),
                        host="n2"))  # fmt: skip
    groups = group_ranks(ranks)
    assert [g.ranks for g in groups] == [[1], [0, 2, 3, 4, 5, 6, 7]]
    hosts = {r.rank: r.host or "" for r in ranks}
    assert summarize(groups, hosts) == (
        "rank 1 on n2 in loader.py:41 next_batch; ranks 0, 2-7 on n1 wait in all_reduce <- train.py:88 step")


def test_every_rank_deadlocked_alike_is_one_group() -> None:
    groups = group_ranks([stacks(r, *ALL_REDUCE, host=f"n{r % 2}") for r in range(4)])
    assert [g.ranks for g in groups] == [[0, 1, 2, 3]]
    assert summarize(groups, {r: f"n{r % 2}" for r in range(4)}) == (
        "ranks 0-3 wait in all_reduce <- train.py:88 step")
    assert summarize(group_ranks([stacks(5, *ALL_REDUCE)]), {5: "n9"}) == (
        "rank 5 on n9 waits in all_reduce <- train.py:88 step")


def test_ranks_without_a_stack_come_last_with_their_note() -> None:
    silent = RankStacks(rank=0, host="n1", note="no stack written within 3 s")
    groups = group_ranks([silent, stacks(1, ("/job/a.py", 1, "f")), stacks(2, ("/job/a.py", 1, "f"))])
    assert [g.ranks for g in groups] == [[1, 2], [0]]
    assert summarize(groups, {}) == "ranks 1, 2 in a.py:1 f; rank 0: no stack (no stack written within 3 s)"


def test_many_groups_are_counted_not_all_named() -> None:
    groups = group_ranks([stacks(r, ("/job/a.py", r + 1, "f")) for r in range(10)])
    text = summarize(groups, {})
    assert text.startswith("rank 0 in a.py:1 f; rank 1 in a.py:2 f")
    assert text.endswith("; 6 more groups (ranks 4-9)")


def test_format_ranks() -> None:
    assert format_ranks([0, 2, 3, 4, 5, 6, 7]) == "0, 2-7"
    assert format_ranks([7, 1, 0, 1]) == "0, 1, 7"
    assert format_ranks([0, 1, 2, 4, 5, 6, 9]) == "0-2, 4-6, 9"
    assert format_ranks([]) == ""


def test_own_code_and_collectives() -> None:
    assert not is_own_code("/usr/lib/python3.11/threading.py") and not is_own_code("<frozen runpy>")
    assert not is_own_code("/srv/ty/runtime/worker-0123456789abcdef/worker/runner.py")
    assert is_own_code("/srv/ty/runtime/worker-0123456789abcdef/worker/tasks/train.py")
    assert is_own_code("/home/u/project/train.py") and is_own_code("/home/u/project/worker/loader.py")
    frames = [Frame(file=f, line=n, function=fn) for f, n, fn in ALL_REDUCE]
    assert collective_of(frames) == ("all_reduce", frames[2])
    assert collective_of(frames[2:]) is None
    assert collective_of(frames[:2]) == ("all_reduce", None)
    assert place_of([ThreadStack(name="0x1", frames=frames[:2])]) == "wait in all_reduce"
    assert place_of([]) is None and place_of([ThreadStack(name="0x1")]) is None


GLOO_RANK = """\
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch, torch.distributed as dist
from worker.spec import JobFiles
from worker.stacks import install_stack_dumps
rank, store = int(sys.argv[1]), sys.argv[2]
install_stack_dumps(JobFiles(Path(sys.argv[3])), rank, 1, f"host{rank}")
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3,
                        timeout=timedelta(seconds=120))
def next_batch():
    print("go", flush=True)
    time.sleep(3600)
def step():
    print("go", flush=True)
    dist.all_reduce(torch.ones(4))
if rank == 1:
    next_batch()
step()
"""


def test_three_gloo_ranks_one_apart_in_real_processes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    script = tmp_path / "train.py"
    script.write_text(GLOO_RANK)
    job = tmp_path / "job"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp_path / "store"), str(job)],
                              env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
             for r in range(3)]  # fmt: skip
    try:
        for rank in ranks:
            assert rank.stdout is not None and rank.stdout.readline().strip() == "go"
        time.sleep(1.0)  # ranks 0 and 2 are inside all_reduce
        sizes = {r: (job / "stacks" / f"rank{r}.txt").stat().st_size for r in range(3)}
        for rank in ranks:
            os.kill(rank.pid, signal.SIGURG)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            (job / "stacks" / f"rank{r}.txt").stat().st_size == sizes[r] for r in range(3)
        ):
            time.sleep(0.05)
        time.sleep(0.3)
        captured = [RankStacks(rank=r, host=f"host{r}",
                               threads=parse_faulthandler((job / "stacks" / f"rank{r}.txt").read_text()))
                    for r in range(3)]  # fmt: skip
        for _ in range(2):  # more captures: the collective is not interrupted (no EINTR reaches gloo)
            for rank in ranks:
                os.kill(rank.pid, signal.SIGURG)
            time.sleep(1.0)
        assert [rank.poll() for rank in ranks] == [None, None, None]
        assert (job / "stacks" / "rank0.txt").read_text().count(" in step\n") == 3  # a dump each time
    finally:
        for rank in ranks:
            os.killpg(rank.pid, signal.SIGKILL)
            rank.wait(timeout=30)
    groups = group_ranks(captured)
    assert [g.ranks for g in groups] == [[1], [0, 2]]
    assert summarize(groups, {r: f"host{r}" for r in range(3)}) == (
        "rank 1 on host1 in train.py:13 next_batch; ranks 0, 2 wait in all_reduce <- train.py:16 step")
