"""PyTorch's NCCL flight recorder dumps, read without trusting them: which rank is behind.

An NCCL rank (worker.stacks.flight_recorder_env) keeps a ring buffer of its last collectives and, on a
collective's timeout, dumps it to `<job>/stacks/nccl-rank<r>` (JobFiles.flight_recorder): PyTorch's
pickle (torch::jit::Pickler, protocol 2) of plain containers, in its documented format:

    {"version": "2.10",
     "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
     "pg_status": {"0": {"last_enqueued_collective": 2, "last_started_collective": -1,
                         "last_completed_collective": 2}},
     "entries": [{"record_id": 0, "pg_id": 0, "process_group": ("0", "default_pg"),
                  "collective_seq_id": 1, "p2p_seq_id": 0, "op_id": 1,
                  "profiling_name": "nccl:all_reduce", "state": "completed",   # scheduled | started
                  "input_sizes": [[3, 4]], "frames": [{"name": ..., "filename": ..., "line": ...}],
                  ...}, ...]}

A job writes those bytes, and pickle.loads runs whatever a pickle names. So: the bytes are bounded by
the reader (service.jobfs), and the unpickler here resolves no name at all but the four list and type
builders PyTorch's own pickler writes for typed lists (`torch.jit._pickle.build_intlist`, ...), which
it maps to functions of its own; every other global, extension or persistent id is refused. A dump
that holds a number of absurd size (past MAX_INT_DIGITS digits: Python would refuse even to write it
as text) is refused whole, in either format, and its rank reported as unreadable. What it keeps is
only numbers and short cleaned text.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field

from worker.spec import clean_text

MAX_DUMP_BYTES = 1024 * 1024  # a dump past this is not parsed (the reader reads no more anyway)
MAX_ENTRIES = 10_000  # entries looked at in one dump (PyTorch keeps 2,000 by default)
MAX_GROUPS = 64  # process groups kept of one dump
MAX_SEQ = 2**62
MAX_INT_DIGITS = 40  # a number longer than this in a dump is no counter, id or size of PyTorch's
MAX_INT = 10**MAX_INT_DIGITS
MAX_TEXT = 200


class LastCollective(BaseModel):
    """The last collective one rank recorded in one process group."""

    seq: int  # collective_seq_id: the n-th collective of that group on this rank
    op: str  # profiling_name, e.g. "nccl:all_reduce"
    state: str  # scheduled | started | completed


class FlightRecord(BaseModel):
    """What one rank's dump says: PyTorch's format version and, per process group (its name in the
    dump), the last collective the rank recorded."""

    version: str
    groups: dict[str, LastCollective] = Field(default_factory=dict)
    entries: int = 0  # entries read


def _typed_list(items: Any) -> list[Any]:
    if not isinstance(items, list):
        raise pickle.UnpicklingError("a typed list that is no list")
    return items


def _type_tag(value: Any, _type: Any = None) -> Any:
    return value  # restore_type_tag(value, "Dict[str, int]"): the type only matters to TorchScript


_BUILDERS: dict[tuple[str, str], Any] = {
    ("torch.jit._pickle", "build_intlist"): _typed_list,
    ("torch.jit._pickle", "build_doublelist"): _typed_list,
    ("torch.jit._pickle", "build_boollist"): _typed_list,
    ("torch.jit._pickle", "restore_type_tag"): _type_tag,
}


class _Refusing(pickle.Unpickler):
    """An unpickler that imports nothing: plain containers, and PyTorch's typed-list builders mapped
    to our own functions; every other name is refused."""

    def find_class(self, module: str, name: str) -> Any:
        builder = _BUILDERS.get((module, name))
        if builder is None:
            raise pickle.UnpicklingError(f"refused {clean_text(module, 80)}.{clean_text(name, 80)}")
        return builder

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id")


def load_dump(data: bytes) -> Any:
    """The dump's object (pickle or PyTorch's JSON dump), or None when it is neither, too large, or
    names anything it may not."""
    if len(data) > MAX_DUMP_BYTES:
        return None
    try:
        if data[:1] == b"{":
            return json.loads(data, parse_int=_json_int)
        loaded = _Refusing(io.BytesIO(data)).load()
    except Exception:  # any malformed byte string: UnpicklingError, EOFError, ValueError, TypeError, ...
        return None
    return None if _holds_absurd_int(loaded) else loaded


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError("a number of absurd size")
    return int(text)


def _holds_absurd_int(loaded: Any) -> bool:
    """Whether any int in the loaded pickle is MAX_INT or more in size; each container looked at once
    (a pickle's objects may share themselves), without recursion (they may nest deep)."""
    seen: set[int] = set()
    todo = [loaded]
    while todo:
        value = todo.pop()
        if isinstance(value, int):
            if not -MAX_INT < value < MAX_INT:
                return True
        elif isinstance(value, list | tuple | dict) and id(value) not in seen:
            seen.add(id(value))
            todo.extend(value.values() if isinstance(value, dict) else value)
            if isinstance(value, dict):
                todo.extend(value.keys())
    return False


def parse_flight_recorder(data: bytes) -> FlightRecord | None:
    """One rank's dump read: None for one that is not a flight recorder dump (or not safe to read)."""
    dump = load_dump(data)
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        return None
    version = dump.get("version")
    if not isinstance(version, str):
        return None
    groups: dict[str, LastCollective] = {}
    entries = dump.get("entries", [])[:MAX_ENTRIES]
    for entry in entries:
        found = _collective(entry)
        if found is None:
            continue
        group, last = found
        if group in groups and groups[group].seq >= last.seq:
            continue
        if group in groups or len(groups) < MAX_GROUPS:
            groups[group] = last
    if not groups:
        groups = _from_status(dump.get("pg_status"))
    return FlightRecord(version=clean_text(version, 20), groups=groups, entries=len(entries))


def _collective(entry: Any) -> tuple[str, LastCollective] | None:
    """(process group, collective) of one entry; None for a point-to-point one or an unusable one."""
    if not isinstance(entry, dict) or entry.get("is_p2p") is True:
        return None
    seq, op, state, group = (entry.get("collective_seq_id"), entry.get("profiling_name"), entry.get("state"),
                             entry.get("process_group"))  # fmt: skip
    if not _usable_seq(seq) or not isinstance(op, str):
        return None
    name = group[0] if isinstance(group, list | tuple) and group else entry.get("pg_id", "0")
    if not isinstance(name, str | int) or isinstance(name, bool):
        return None
    return clean_text(str(name), MAX_TEXT), LastCollective(
        seq=seq, op=clean_text(op, MAX_TEXT), state=clean_text(state, 20) if isinstance(state, str) else ""
    )


def _usable_seq(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_SEQ


def _from_status(status: Any) -> dict[str, LastCollective]:
    """Without entries (a buffer of size 0): pg_status's last enqueued collective of each group."""
    groups: dict[str, LastCollective] = {}
    if not isinstance(status, dict):
        return groups
    for key, value in list(status.items())[:MAX_GROUPS]:
        if not isinstance(value, dict):
            continue
        seq = value.get("last_enqueued_collective")
        seq = int(seq) if isinstance(seq, str) and seq.isascii() and seq.isdigit() and len(seq) < 18 else seq
        if _usable_seq(seq) and isinstance(key, str | int):
            groups[clean_text(str(key), MAX_TEXT)] = LastCollective(seq=seq, op="", state="enqueued")
    return groups


def behind_ranks(records: Mapping[int, FlightRecord]) -> str | None:
    """Which rank is behind in the collective sequence, in words, or None when no rank is:
    "rank 3 is behind in process group 0: at #41 nccl:all_reduce (completed) while ranks 0-2, 4-7
    reached #42 nccl:all_reduce (started)". The first process group (by name) with a laggard."""
    from service.domain.stacks import format_ranks  # the one way ranks are written

    names = sorted({name for record in records.values() for name in record.groups}, key=_group_order)
    for name in names:
        lasts = {rank: record.groups[name] for rank, record in records.items() if name in record.groups}
        if len(lasts) < 2:
            continue
        top = max(last.seq for last in lasts.values())
        behind = sorted(rank for rank, last in lasts.items() if last.seq < top)
        if not behind:
            continue
        ahead = sorted(rank for rank, last in lasts.items() if last.seq == top)
        slow = lasts[behind[0]]
        who = f"rank {behind[0]} is" if len(behind) == 1 else f"ranks {format_ranks(behind)} are"
        theirs = "rank" if len(ahead) == 1 else "ranks"
        return clean_text(f"{who} behind in process group {name}: at {_said(slow)} while {theirs} "
                          f"{format_ranks(ahead)} reached {_said(lasts[ahead[0]])}", 1000)  # fmt: skip
    return None


def _said(last: LastCollective) -> str:
    return f"#{last.seq}" + (f" {last.op}" if last.op else "") + (f" ({last.state})" if last.state else "")


def _group_order(name: str) -> tuple[int, str]:
    return (0, f"{int(name):020d}") if name.isascii() and name.isdigit() and len(name) < 18 else (1, name)
