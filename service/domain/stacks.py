"""Every rank's stacks, read from what faulthandler wrote: parsed, grouped and summed up in one line.

Pure (no I/O): the job folder's bytes are read by service.jobfs (bounded, no links) and handed here
as text. What a rank wrote is untrusted: the parser takes any text, keeps at most MAX_THREADS threads
of MAX_FRAMES frames each, cuts every name, cleans it (no NUL, no lone surrogate), and ignores any line
it does not know. faulthandler writes, for each thread (the newest first, the main thread last):

    Thread 0x00007f155b0646c0 (most recent call first):
      File "/job/code/loader.py", line 41 in next_batch
      File "/usr/lib/python3.11/threading.py", line 982 in run

("Current thread 0x... (most recent call first):" for the thread that ran the signal handler; a
name in brackets after the id on newer Pythons; "  <no Python frame>", "  ..." past 100 frames.)

Ranks whose main threads stand at the same frames form a group; the smallest group comes first, so
the rank that stands apart is named first: "rank 1 on n2 in loader.py:41 next_batch; ranks 0, 2-7
wait in all_reduce <- train.py:88 step". The NCCL flight recorder's dumps are read in
service.domain.flight_recorder (re-exported here).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence

from pydantic import BaseModel, Field

from service.domain.flight_recorder import FlightRecord, LastCollective, behind_ranks, parse_flight_recorder
from worker.spec import ascii_int, clean_text

MAX_THREADS = 64  # threads kept of one rank's dump
MAX_FRAMES = 100  # frames kept of one thread (faulthandler itself writes at most 100)
MAX_NAME_CHARS = 500  # of a file name or a function name (faulthandler cuts its own at 500)
MAX_PARSED_CHARS = 1024 * 1024  # of one rank's text: the reader gives far less
MAX_GROUPS_NAMED = 4  # groups a summary names; the rest are counted
MAX_SUMMARY_CHARS = 1000

_HEADER = re.compile(r"(Current thread|Thread) (0x[0-9a-fA-F]{1,32})(?: \[([^\]\n]{0,200})\])?"
                     r" \(most recent call first\):")  # fmt: skip
_SINGLE = "Stack (most recent call first):"  # all_threads=False, or a Python without threads
_FRAME = re.compile(r'  File "(.*)", line (\d{1,18}|\?\?\?) in (.*)')
# torchyard's own modules, which stand between the job's code and the scheduler: not the job's code.
_TORCHYARD = re.compile(r"/worker/(launch|runner|distributed|context|files|stacks|rendezvous|gpu_stats"
                        r"|hostlist|spec/(__init__|run_spec|job_files|records|cleaning))\.py$")
_STDLIB = re.compile(r"/lib(64)?/python\d+(\.\d+)?t?/")
_WRAPPERS = frozenset({"wrapper", "_wrapper", "inner", "_fn", "decorate_context", "wrapped"})


class Frame(BaseModel):
    file: str
    line: int  # 0: faulthandler did not know it ("???")
    function: str

    @property
    def short(self) -> str:
        """"train.py:41 next_batch": the file's last name only."""
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line} {self.function}"


class ThreadStack(BaseModel):
    name: str  # faulthandler's thread id ("0x00007f..."), with its name where the Python gives one
    current: bool = False  # the thread that ran the signal handler
    frames: list[Frame] = Field(default_factory=list)  # innermost first, as faulthandler writes them
    truncated: bool = False  # more frames than were kept


class RankStacks(BaseModel):
    rank: int
    host: str | None = None
    captured_at: float | None = None  # seconds since the epoch
    threads: list[ThreadStack] = Field(default_factory=list)  # as dumped: the main thread last
    note: str | None = None  # why there is no stack, or what was cut ("no stack written within 3 s")


class StackGroup(BaseModel):
    ranks: list[int]
    threads: list[ThreadStack] = Field(default_factory=list)  # the first rank's, for all of them
    note: str | None = None  # the first rank's note


def parse_faulthandler(text: str) -> list[ThreadStack]:
    """The threads of the first dump in `text` (a later dump, from a second signal, is ignored),
    main thread last; [] for text with no thread in it. Bounded, and never raises."""
    threads: list[ThreadStack] = []
    seen: set[str] = set()
    thread: ThreadStack | None = None
    for line in text[:MAX_PARSED_CHARS].splitlines():
        if header := _HEADER.fullmatch(line):
            ident = header.group(2).lower()
            if ident in seen:
                break  # a second dump begins
            seen.add(ident)
            name = ident if header.group(3) is None else f"{ident} [{_name(header.group(3))}]"
            thread = _add(threads, ThreadStack(name=name, current=header.group(1) == "Current thread"))
        elif line == _SINGLE:
            if threads:
                break
            thread = _add(threads, ThreadStack(name="main", current=True))
        elif thread is not None and (frame := _FRAME.fullmatch(line)):
            if len(thread.frames) >= MAX_FRAMES:
                thread.truncated = True
                continue
            number = 0 if frame.group(2) == "???" else ascii_int(frame.group(2)) or 0
            thread.frames.append(Frame(file=_name(frame.group(1)), line=number,
                                       function=_name(frame.group(3))))  # fmt: skip
        elif thread is not None and line.strip() == "...":
            thread.truncated = True
        if len(threads) > MAX_THREADS:
            threads.pop()
            break
    return threads


def _add(threads: list[ThreadStack], thread: ThreadStack) -> ThreadStack:
    threads.append(thread)
    return thread


def _name(text: str) -> str:
    return clean_text(text, MAX_NAME_CHARS)


def main_thread(threads: Sequence[ThreadStack]) -> ThreadStack | None:
    """The rank's main thread: faulthandler writes it last (the interpreter's oldest thread)."""
    return threads[-1] if threads else None


def is_own_code(file: str) -> bool:
    """Whether `file` is the job's own code, not the interpreter's library, an installed package
    (torch, submitit) or torchyard's worker (whose tasks/, our demonstrations, are a job's)."""
    if file.startswith("<") or "/site-packages/" in file or "/dist-packages/" in file:
        return False
    if _STDLIB.search(file):
        return False
    return "/worker/tasks/" in file or not _TORCHYARD.search(file)


def collective_of(frames: Sequence[Frame]) -> tuple[str, Frame | None] | None:
    """(the torch.distributed call, the job's frame that made it) when the innermost frames are in
    torch.distributed (a rank waiting in a collective), else None."""
    op: str | None = None
    for frame in frames:
        if is_own_code(frame.file):
            return (op, frame) if op is not None else None
        if "/torch/distributed/" in frame.file and frame.function not in _WRAPPERS:
            op = frame.function  # the outermost one: what the job called (all_gather_object, not all_gather)
    return (op, None) if op is not None else None


def place_of(threads: Sequence[ThreadStack]) -> str | None:
    """Where a rank's main thread is, in words: "in loader.py:41 next_batch" (its innermost frame of
    the job's own code, else its innermost frame), "wait in all_reduce <- train.py:88 step" when it
    waits in a torch.distributed call; None without a stack."""
    main = main_thread(threads)
    if main is None or not main.frames:
        return None
    found = collective_of(main.frames)
    if found is not None:
        op, caller = found
        return f"wait in {op}" + (f" <- {caller.short}" if caller is not None else "")
    own = next((frame for frame in main.frames if is_own_code(frame.file)), main.frames[0])
    return f"in {own.short}"


def group_ranks(ranks: Iterable[RankStacks]) -> list[StackGroup]:
    """Ranks grouped by their main thread's frames; the smallest group first (the odd rank named
    first), then by lowest rank; ranks without a stack last."""
    groups: dict[tuple[tuple[str, int, str], ...] | None, list[RankStacks]] = {}
    for rank in sorted(ranks, key=lambda item: item.rank):
        main = main_thread(rank.threads)
        key = None if main is None else tuple((f.file, f.line, f.function) for f in main.frames)
        groups.setdefault(key, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (item[0] is None, len(item[1]), item[1][0].rank))
    return [StackGroup(ranks=[member.rank for member in members], threads=members[0].threads,
                       note=members[0].note) for _, members in ordered]  # fmt: skip


def format_ranks(ranks: Iterable[int]) -> str:
    """[0, 2, 3, 4, 5, 6, 7] -> "0, 2-7": runs of three or more as a range."""
    numbers = sorted(set(ranks))
    parts: list[str] = []
    start = 0
    while start < len(numbers):
        end = start
        while end + 1 < len(numbers) and numbers[end + 1] == numbers[end] + 1:
            end += 1
        if end - start >= 2:
            parts.append(f"{numbers[start]}-{numbers[end]}")
        else:
            parts.extend(str(number) for number in numbers[start : end + 1])
        start = end + 1
    return ", ".join(parts)


def label_ranks(ranks: Sequence[int], hosts: Mapping[int, str]) -> str:
    """"rank 1 on n2" (its host when known), "ranks 0, 2-7" (their host when they share one)."""
    if len(ranks) == 1:
        host = hosts.get(ranks[0])
        return f"rank {ranks[0]}" + (f" on {host}" if host else "")
    shared = {hosts.get(rank) for rank in ranks}
    host = shared.pop() if len(shared) == 1 else None
    return f"ranks {format_ranks(ranks)}" + (f" on {host}" if host else "")


def summarize(groups: Sequence[StackGroup], hosts: Mapping[int, str]) -> str:
    """One line for a job's reason, event or card: each group and where it is, the odd rank first.
    "rank 1 on n2 in train.py:41 next_batch; ranks 0, 2 wait in all_reduce <- train.py:88 step"."""
    parts: list[str] = []
    for group in groups[:MAX_GROUPS_NAMED]:
        place = place_of(group.threads)
        label = label_ranks(group.ranks, hosts)
        if place is None:
            parts.append(f"{label}: no stack" + (f" ({group.note})" if group.note else ""))
            continue
        if len(group.ranks) == 1 and place.startswith("wait "):
            place = "waits " + place.removeprefix("wait ")
        parts.append(f"{label} {place}")
    if len(groups) > MAX_GROUPS_NAMED:
        rest = [rank for group in groups[MAX_GROUPS_NAMED:] for rank in group.ranks]
        parts.append(f"{len(groups) - MAX_GROUPS_NAMED} more groups (ranks {format_ranks(rest)})")
    text = "; ".join(parts) if parts else "no stacks"
    return clean_text(text, MAX_SUMMARY_CHARS)


__all__ = [
    "FlightRecord",
    "Frame",
    "LastCollective",
    "RankStacks",
    "StackGroup",
    "ThreadStack",
    "behind_ranks",
    "collective_of",
    "format_ranks",
    "group_ranks",
    "is_own_code",
    "label_ranks",
    "main_thread",
    "parse_faulthandler",
    "parse_flight_recorder",
    "place_of",
    "summarize",
]
