"""worker.stacks in real processes: a stack on SIGURG from a rank stuck in C code holding the GIL, the
activity file going stale then, and moving with a busy loop; a forked child stays out of the file;
NCCL's flight recorder defaults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.domain.stacks import main_thread, parse_faulthandler, place_of
from tests.support import ROOT
from worker.spec import JobFiles, RankActivity, parse_activity
from worker.stacks import (
    NCCL_TRACE_ENTRIES,
    ActivitySampler,
    dump_flight_recorder,
    flight_recorder_env,
    install_stack_dumps,
    is_own_code,
    library_folders,
    uninstall_stack_dumps,
    where_in,
)

Children = list[subprocess.Popen[str]]

INSTALL = """\
import os, re, sys, time
from pathlib import Path
from worker.spec import JobFiles
from worker.stacks import install_stack_dumps
install_stack_dumps(JobFiles(Path(sys.argv[1])), 0, 1, "h1", interval_s=0.2)
"""


def run_child(tmp_path: Path, body: str) -> subprocess.Popen[str]:
    """A process of its own session (so a signal to its group reaches it and its children alone)
    that installed the dumps, then runs `body`; it prints "go" when `body` begins."""
    script = tmp_path / "child.py"
    script.write_text(INSTALL + textwrap.dedent(body))
    return subprocess.Popen([sys.executable, str(script), str(tmp_path / "job")], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip


@pytest.fixture
def children() -> Iterator[Children]:
    started: Children = []
    yield started
    for child in started:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)  # its own session: it and what it forked
        child.wait(timeout=10)


def wait_for(check: Callable[[], object], timeout_s: float = 10.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := check():
            return found
        time.sleep(0.05)
    raise AssertionError("timed out")


def line_of(script: Path, text: str) -> int:
    return next(number for number, line in enumerate(script.read_text().splitlines(), 1) if text in line)


def test_a_rank_stuck_in_a_regex_holding_the_gil_still_gives_its_stack(tmp_path: Path,
                                                                       children: Children) -> None:
    child = run_child(tmp_path, """\
        def stuck():
            print("go", flush=True)
            re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking, all in C, GIL held
        stuck()
        """)
    children.append(child)
    assert child.stdout is not None and child.stdout.readline().strip() == "go"
    files = JobFiles(tmp_path / "job")
    time.sleep(0.5)  # well inside the regex
    before = parse_activity(files.activity(0).read_text())
    os.kill(child.pid, signal.SIGURG)
    wait_for(lambda: files.stacks(0).read_text())
    time.sleep(0.2)  # the whole dump, not its first lines: every check below reads it whole
    text = files.stacks(0).read_text()
    main = main_thread(parse_faulthandler(text))
    assert main is not None
    regex_line = line_of(tmp_path / "child.py", 're.match(r"(a+)+$"')
    assert main.frames[0].function == "match"  # re's own Python frame, then the call in the job's code
    assert (main.frames[1].file, main.frames[1].line, main.frames[1].function) == (
        str(tmp_path / "child.py"), regex_line, "stuck"), text
    assert place_of(parse_faulthandler(text)) == f"in child.py:{regex_line} stuck"
    # Its Python cannot run: the activity thread wrote nothing since (its interval is 0.2 s).
    time.sleep(1.0)
    after = parse_activity(files.activity(0).read_text())
    assert before is not None and after is not None and after.time == before.time
    assert child.poll() is None, "SIGURG did not hurt the rank"


def test_activity_moves_with_a_busy_loop_and_stands_still_in_a_sleep(tmp_path: Path,
                                                                     children: Children) -> None:
    child = run_child(tmp_path, """\
        def one(): return sum(range(1000))
        def two(): return sum(range(2000))
        def nap():
            time.sleep(3600)
        print("go", flush=True)
        stop = Path(sys.argv[1]).parent / "stop"
        while not stop.exists():
            one(); two()
        print("napping", flush=True)
        nap()
        """)
    children.append(child)
    assert child.stdout is not None and child.stdout.readline().strip() == "go"
    files = JobFiles(tmp_path / "job")
    busy: list[RankActivity] = []

    def three_changes() -> bool:  # however loaded the machine, the busy loop's samples differ
        record = parse_activity(files.activity(0).read_text())
        if record is not None and record not in busy:
            busy.append(record)
        return len({record.changed_at for record in busy}) >= 3

    wait_for(three_changes, timeout_s=30)
    assert all(record.where and record.where.startswith(str(tmp_path / "child.py")) for record in busy)
    (tmp_path / "stop").touch()
    assert child.stdout.readline().strip() == "napping"

    def napping() -> RankActivity | None:
        record = parse_activity(files.activity(0).read_text())
        return record if record is not None and str(record.where).endswith(" nap") else None

    first = wait_for(napping)
    assert isinstance(first, RankActivity)
    later = wait_for(lambda: (found := napping()) is not None and found.time > first.time and found)
    assert isinstance(later, RankActivity) and later.changed_at == first.changed_at  # alive, not moving
    assert later.where == f"{tmp_path / 'child.py'}:{line_of(tmp_path / 'child.py', 'time.sleep(3600)')} nap"
    assert (later.attempt, later.rank, later.host, later.pid) == (1, 0, "h1", child.pid)


def test_activity_moves_while_the_main_thread_works_inside_one_long_c_call(tmp_path: Path,
                                                                           children: Children) -> None:
    """One call that releases the GIL and computes for a long time (a big backward, here OpenSSL's
    PBKDF2): the same stack at every sample, yet the rank is working, not hung."""
    child = run_child(tmp_path, """\
        import hashlib
        def crunch():
            return hashlib.pbkdf2_hmac("sha256", b"p", b"s", 10**9)
        print("go", flush=True)
        crunch()
        """)
    children.append(child)
    assert child.stdout is not None and child.stdout.readline().strip() == "go"
    files = JobFiles(tmp_path / "job")
    seen: list[RankActivity] = []

    def moving_in_crunch() -> bool:
        record = parse_activity(files.activity(0).read_text())
        if record is not None and str(record.where).endswith(" crunch") and record not in seen:
            seen.append(record)
        return len({record.changed_at for record in seen}) >= 3

    wait_for(moving_in_crunch, timeout_s=30)
    assert len({record.where for record in seen}) == 1  # one stack all along: the CPU time moved it


def test_a_forked_child_ignores_sigurg_and_writes_no_stack(tmp_path: Path, children: Children) -> None:
    child = run_child(tmp_path, """\
        pid = os.fork()
        if pid == 0:
            def grandchild_naps(): time.sleep(3600)
            grandchild_naps()
        def rank_main(): time.sleep(3600)
        print(pid, flush=True)
        rank_main()
        """)
    children.append(child)
    assert child.stdout is not None
    forked = int(child.stdout.readline())
    files = JobFiles(tmp_path / "job")
    time.sleep(0.3)
    os.killpg(child.pid, signal.SIGURG)  # the whole group, as the local backend signals a job
    wait_for(lambda: files.stacks(0).stat().st_size)
    time.sleep(0.5)
    text = files.stacks(0).read_text()
    assert "rank_main" in text and "grandchild_naps" not in text
    assert text.count("(most recent call first):") == 2  # the rank's main and activity threads, once
    assert child.poll() is None
    os.kill(forked, 0)  # alive: SIGURG is ignored where no handler is installed


def test_where_is_the_jobs_own_code_not_a_library() -> None:
    library = library_folders()
    json_file = json.__file__
    assert not is_own_code(json_file, library) and not is_own_code("<frozen runpy>", library)
    assert not is_own_code(str(ROOT / "worker" / "runner.py"), library)
    assert is_own_code(str(ROOT / "worker" / "tasks" / "train.py"), library)
    assert is_own_code("/job/code/train.py", library)
    stack = [(json_file, 3, "loads"), ("/job/code/train.py", 41, "next_batch"),
             ("/job/code/train.py", 9, "main")]
    assert where_in(stack, library) == "/job/code/train.py:41 next_batch"
    assert where_in([(json_file, 3, "loads")], library) == f"{json_file}:3 loads"
    assert where_in([], library) is None


def test_a_sample_of_a_thread_standing_still_keeps_its_changed_at(tmp_path: Path) -> None:
    path = tmp_path / "activity" / "rank2.json"
    sampler = ActivitySampler(path, attempt=4, rank=2, host="n2", interval_s=60)
    sampler.start()
    try:  # the main thread (this test) samples itself from one line: the same stack each time
        first, second = (sampler.sample(now=now) for now in (1000.0, 1005.0))
        assert (second["time"], second["changed_at"]) == (1005.0, 1000.0) == (1005.0, first["changed_at"])
        assert str(first["where"]).endswith(" <genexpr>")  # this file is the job's own code here
        record = parse_activity(path.read_text())
        assert record is not None and (record.rank, record.attempt, record.changed_at) == (2, 4, 1000.0)
    finally:
        sampler.stop()


def test_nccl_ranks_get_the_flight_recorder_unless_the_job_set_it(tmp_path: Path) -> None:
    files = JobFiles(tmp_path)
    environ: dict[str, str] = {}
    assert flight_recorder_env(files, environ) == environ == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": NCCL_TRACE_ENTRIES,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "stacks" / "nccl-rank"),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    assert (tmp_path / "stacks").is_dir() and files.flight_recorder(3) == tmp_path / "stacks" / "nccl-rank3"
    mine = {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}  # the newer alias counts too
    set_now = flight_recorder_env(files, mine)
    assert set_now == {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(files.flight_recorder_prefix)}
    assert mine["TORCH_FR_BUFFER_SIZE"] == "0" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in mine


def test_a_capture_is_followed_by_the_capture_hook(tmp_path: Path) -> None:
    sampler = ActivitySampler(tmp_path / "activity" / "rank0.json", attempt=1, rank=0, host="n1",
                              interval_s=60)
    captured: list[float] = []
    with open(tmp_path / "rank0.txt", "ab", buffering=0) as stacks:
        stacks.write(b"an earlier capture\n")
        sampler.watch_captures(stacks, lambda: captured.append(time.monotonic()))
        sampler.start()
        try:
            time.sleep(0.7)
            assert captured == []  # nothing new since it began watching
            stacks.write(b"Thread 0x1 (most recent call first):\n")  # as faulthandler appends on SIGURG
            wait_for(lambda: captured, timeout_s=3)
            time.sleep(0.7)
            assert len(captured) == 1
        finally:
            sampler.stop()


def test_no_flight_recorder_dump_without_nccl(tmp_path: Path) -> None:
    assert not dump_flight_recorder(tmp_path / "nccl-rank0")  # torch.distributed is not up here
    assert not (tmp_path / "nccl-rank0").exists()


def test_a_rank_that_cannot_be_watched_still_runs(tmp_path: Path) -> None:
    (tmp_path / "stacks").write_text("a file where the folder goes")
    (tmp_path / "activity").write_text("and another")
    try:
        install_stack_dumps(JobFiles(tmp_path), 0, 1, "n1")  # logs, does not raise
    finally:
        uninstall_stack_dumps()


@pytest.mark.parametrize(("cpu_share", "worked"), [(0.06, True), (0.5, True), (0.005, False), (0.0, False)])
def test_a_main_thread_working_on_a_crowded_node_counts_as_working(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu_share: float, worked: bool
) -> None:
    """A healthy rank computing on a node with 16 busy threads a core gets a sixteenth of one: it
    works, though at the same stack every sample; a waiting rank spends next to nothing."""
    sampler = ActivitySampler(tmp_path / "activity", attempt=1, rank=0, host="h1")
    sampler._cpu_clock = 7
    cpu = iter([10.0, 10.0 + 5.0 * cpu_share])
    monkeypatch.setattr("worker.stacks.time.clock_gettime", lambda clock: next(cpu))

    assert sampler._main_thread_worked(100.0) is False  # the first sample only notes the clock
    assert sampler._main_thread_worked(105.0) is worked
