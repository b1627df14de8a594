"""NCCL flight recorder dumps in PyTorch's documented format (a pickle of plain containers, typed lists
as torch.jit's pickler writes them), which rank is behind, and dumps that must not be loaded."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from service.domain.stacks import FlightRecord, LastCollective, behind_ranks, parse_flight_recorder


class IntList(list[int]):
    """A list that pickles as torch::jit::Pickler writes an int list: torch.jit._pickle.build_intlist."""

    def __reduce__(self) -> tuple[Any, ...]:
        torch_pickle = pytest.importorskip("torch.jit._pickle")
        return (torch_pickle.build_intlist, (list(self),))


def entry(record_id: int, seq: int, state: str, op: str = "nccl:all_reduce", pg: str = "0",
          typed: bool = False) -> dict[str, Any]:
    """One entry as PyTorch's FlightRecorder dumps it (version 2.x keys)."""
    sizes: list[Any] = [IntList([3, 4])] if typed else [[3, 4]]
    return {
        "record_id": record_id, "pg_id": int(pg), "process_group": (pg, "default_pg"),
        "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": op,
        "time_created_ns": 1_700_000_000_000_000_000 + record_id, "duration_ms": None,
        "input_sizes": sizes, "input_dtypes": ["Float"], "output_sizes": sizes, "output_dtypes": ["Float"],
        "state": state, "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
        "retired": state == "completed", "timeout_ms": 600000, "is_p2p": False,
        "frames": [{"name": "step", "filename": "/job/code/train.py", "line": 88}],
    }  # fmt: skip


def dump(last_seq: int, last_state: str, typed: bool = False, ranks: str = "[0, 1, 2, 3]") -> bytes:
    entries = [entry(n, n + 1, "completed", typed=typed) for n in range(last_seq - 1)]
    entries.append(entry(last_seq - 1, last_seq, last_state, typed=typed))
    entries.append({**entry(last_seq, 0, "completed"), "is_p2p": True, "profiling_name": "nccl:send 0->1"})
    value = {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
        "pg_status": {"0": {"last_enqueued_collective": last_seq, "last_started_collective": -1,
                            "last_completed_collective": last_seq - 1}},
        "entries": entries,
    }
    return pickle.dumps(value, protocol=2)  # torch::jit::Pickler writes protocol 2


def test_a_documented_dump_gives_each_groups_last_collective() -> None:
    record = parse_flight_recorder(dump(42, "started"))
    assert record == FlightRecord(version="2.10", entries=43,
                                  groups={"0": LastCollective(seq=42, op="nccl:all_reduce", state="started")})


def test_typed_lists_as_torch_writes_them_are_read() -> None:
    data = dump(5, "completed", typed=True)
    assert b"torch.jit._pickle" in data and b"build_intlist" in data
    record = parse_flight_recorder(data)
    assert record is not None and record.groups["0"].seq == 5


def test_the_rank_behind_in_the_sequence_is_named() -> None:
    records = {r: parse_flight_recorder(dump(42, "started")) for r in (0, 1, 2, 4, 5, 6, 7)}
    records[3] = parse_flight_recorder(dump(41, "completed"))
    usable = {rank: record for rank, record in records.items() if record is not None}
    assert behind_ranks(usable) == ("rank 3 is behind in process group 0: at #41 nccl:all_reduce (completed) "
                                    "while ranks 0-2, 4-7 reached #42 nccl:all_reduce (started)")  # fmt: skip
    level = {rank: record for rank, record in usable.items() if rank != 3}
    assert behind_ranks(level) is None and behind_ranks({}) is None and behind_ranks({0: usable[0]}) is None


def test_without_entries_the_status_tells_the_sequence() -> None:
    value = {"version": "2.10", "pg_config": {}, "entries": [],
             "pg_status": {"0": {"last_enqueued_collective": "7"}}}  # JSON dumps write numbers as text
    record = parse_flight_recorder(json.dumps(value).encode())
    assert record is not None and record.groups == {"0": LastCollective(seq=7, op="", state="enqueued")}


class Runs:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("make", [
    lambda tmp: pickle.dumps({"version": "2.10", "entries": [Runs(str(tmp / "ran"))]}),
    lambda tmp: pickle.dumps(Runs(str(tmp / "ran")), protocol=0),
    lambda tmp: b"\x80\x02ctorch.jit._pickle\nbuild_tensorlist\n(]tR.",  # no tensors
    lambda tmp: b"\x80\x02cbuiltins\neval\nX\x04\x00\x00\x001+1q\x00\x85R.",
    lambda tmp: b"\x80\x02P0\n.",  # a persistent id
    lambda tmp: b"\x80\x02\x82\x01.",  # an extension code
    lambda tmp: os.urandom(4096),
    lambda tmp: b"",
    lambda tmp: pickle.dumps({"version": "2.10", "entries": ["x" * (1024 * 1024)]}),  # too large
    lambda tmp: pickle.dumps([1, 2, 3]),
    lambda tmp: pickle.dumps({"version": 2, "entries": []}),
    lambda tmp: b"{" * 100000,
    lambda tmp: b"\x80\x02" + b"]" * 100000 + b"a" * 99999 + b".",  # lists nested 100,000 deep
])
def test_a_dump_that_is_no_dump_or_runs_anything_is_refused(tmp_path: Path, make: Any) -> None:
    assert parse_flight_recorder(make(tmp_path)) is None
    assert not (tmp_path / "ran").exists()


def test_hostile_entries_cost_their_entry_only() -> None:
    good = entry(0, 3, "completed")
    value = {"version": "2.10", "entries": [
        None, 7, {"collective_seq_id": True}, {**good, "collective_seq_id": -1},
        {**good, "collective_seq_id": 2**70}, {**good, "profiling_name": 5}, {**good, "process_group": [[1]]},
        {**good, "profiling_name": "nccl:\x00all_reduce" + "x" * 1000, "collective_seq_id": 2}, good,
    ]}  # fmt: skip
    record = parse_flight_recorder(pickle.dumps(value, protocol=2))
    assert record is not None and record.groups == {"0": LastCollective(seq=3, op="nccl:all_reduce",
                                                                        state="completed")}  # fmt: skip
    shared = [1] * 10
    nested: Any = shared
    for _ in range(60):  # a pickle whose objects share themselves: 2**60 paths, few bytes
        nested = [nested, nested]
    assert parse_flight_recorder(pickle.dumps({"version": "2.10", "entries": nested}, protocol=2)) is not None


HUGE = 10**5000 - 1  # 5,000 digits: past Python's int-to-text limit (4,300)


@pytest.mark.parametrize("value", [
    {"version": "2.10", "entries": [{**entry(0, 1, "started"), "pg_id": HUGE, "process_group": None}]},
    {"version": "2.10", "entries": [entry(0, HUGE, "started")]},
    {"version": "2.10", "entries": [], "pg_status": {HUGE: {"last_enqueued_collective": 1}}},
    {"version": "2.10", "entries": [{**entry(0, 1, "started"), "frames": [{"line": -HUGE}]}]},
])  # fmt: skip
def test_a_dump_holding_a_number_of_absurd_size_is_refused_not_raised(value: dict[str, Any]) -> None:
    assert parse_flight_recorder(pickle.dumps(value, protocol=2)) is None
    text = '{"version": "2.10", "entries": [{"collective_seq_id": ' + "9" * 5000 + "}]}"
    assert parse_flight_recorder(text.encode()) is None
    protocol_0 = b"(dp0\nVversion\np1\nV2.10\np2\nsVentries\np3\n(lp4\nL" + b"9" * 5000 + b"L\nas."
    assert parse_flight_recorder(protocol_0) is None
    large = {"version": "2.10", "entries": [{**entry(0, 1, "started"), "time_created_ns": 10**39}]}
    assert parse_flight_recorder(pickle.dumps(large, protocol=2)) is not None  # large, not absurd
