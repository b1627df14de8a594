"""The supervisor's decisions, with a fake allocation: when it restarts in place, what it records, when
it gives up and why; and how a run's end is told from the ranks' exits and error files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.files import write_error
from worker.spec import RunSpec, parse_restart_line
from worker.supervisor import AttemptCancelled, AttemptEnded, RunEnd, classify, supervise

GLOO_LOST_PEER = "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer"


class FakeRun:
    def __init__(self, end: RunEnd) -> None:
        self.end, self.stopped = end, False

    def ended(self) -> RunEnd | None:
        return self.end

    def stop(self) -> None:
        self.stopped = True

    def settle(self) -> None:
        self.stopped = True


class FakeRuns:
    """An allocation of `hosts`; each run ends as the next of `ends` says; `lost` hosts leave it."""

    def __init__(self, hosts: list[str], ends: list[RunEnd]) -> None:
        self.all, self.ends = hosts, list(ends)
        self.started: list[tuple[int, list[str], str | None]] = []
        self.gone: set[str] = set()

    def hosts(self) -> list[str]:
        return [host for host in self.all if host not in self.gone]

    def start(self, spec_path: Path, run: int, hosts: list[str]) -> FakeRun:
        spec = RunSpec.model_validate_json(spec_path.read_text())
        self.started.append((run, hosts, spec.resume_from))
        end = self.ends.pop(0)
        if end.lost_node and end.node:
            self.gone.add(end.node)
        return FakeRun(end)


def make_spec(tmp_path: Path, **extra: object) -> RunSpec:
    body = {"job_id": 1, "name": "t", "entrypoint": "worker.tasks.seed:ddp_demo", "folder": str(tmp_path),
            "resources": {"nodes": 2, "tasks_per_node": 1}, **extra}
    return RunSpec.model_validate(body)


def records(tmp_path: Path) -> list[dict[str, object]]:
    path = tmp_path / "restarts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


LOST_N2 = RunEnd(ok=False, cause="node_failure", rank=1, node="n2", detail="node down", lost_node=True)


def test_a_lost_node_is_left_out_and_the_spare_taken_from_the_newest_whole_checkpoint(
    tmp_path: Path,
) -> None:
    spec = make_spec(tmp_path)
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    for step in (4, 8):
        (checkpoints / f"ckpt-{step:08d}.pt").write_bytes(b"x")
        (checkpoints / f"ckpt-{step:08d}.json").write_text("{}")
    (checkpoints / "ckpt-00000012.pt").write_bytes(b"half")  # no note: not whole
    runs = FakeRuns(["n1", "n2", "n3"], [LOST_N2, RunEnd(ok=True)])

    supervise(spec, runs)

    assert [(run, hosts) for run, hosts, _ in runs.started] == [(0, ["n1", "n2"]), (1, ["n1", "n3"])]
    assert runs.started[1][2] == str(checkpoints / "ckpt-00000008.pt")
    [record] = records(tmp_path)
    parsed = parse_restart_line(json.dumps(record))
    assert parsed is not None and (parsed.restart, parsed.outcome, parsed.node, parsed.nodes) == (
        1, "restarted", "n2", ["n1", "n3"])
    assert parsed.resumed_step == 8 and parsed.max == 2
    assert parsed.lost_at is not None and parsed.started_at is not None
    assert parsed.started_at >= parsed.lost_at


def test_restarts_spent_end_the_attempt_with_a_give_up_record(tmp_path: Path) -> None:
    killed = RunEnd(ok=False, cause="node_failure", rank=1, node="n2", detail="killed by SIGKILL")
    runs = FakeRuns(["n1", "n2"], [killed, killed])
    with pytest.raises(AttemptEnded, match=r"restarts spent \(1 of 1\)"):
        supervise(make_spec(tmp_path, restarts={"max": 1}), runs)
    assert [r["outcome"] for r in records(tmp_path)] == ["restarted", "gave_up"]
    assert records(tmp_path)[1]["reason"] == "restarts spent (1 of 1)"


def test_no_spare_for_a_lost_node_gives_up_saying_so(tmp_path: Path) -> None:
    with pytest.raises(AttemptEnded, match="no spare node"):
        supervise(make_spec(tmp_path), FakeRuns(["n1", "n2"], [LOST_N2]))
    [gave_up] = records(tmp_path)
    assert gave_up["reason"] == "no spare node: the allocation holds 1 usable node of 2 needed"


@pytest.mark.parametrize(("restarts", "reason"), [
    ({"max": 0}, "restarts in place are off (restarts.max 0)"),
    ({"on": ["hang"]}, "node_failure is not in restarts.on"),
])
def test_a_loss_not_restarted_ends_the_attempt_saying_what_was_lost(
    tmp_path: Path, restarts: dict[str, object], reason: str
) -> None:
    with pytest.raises(AttemptEnded):
        supervise(make_spec(tmp_path, restarts=restarts), FakeRuns(["n1", "n2", "n3"], [LOST_N2]))
    [gave_up] = records(tmp_path)
    assert (gave_up["outcome"], gave_up["rank"], gave_up["node"]) == ("gave_up", 1, "n2")
    assert gave_up["reason"] == reason


def test_the_jobs_own_failure_ends_the_attempt_as_ever_without_a_record(tmp_path: Path) -> None:
    raised = RunEnd(ok=False, cause="failure", rank=0, node="n1", detail="ValueError: bad")
    with pytest.raises(AttemptEnded):
        supervise(make_spec(tmp_path), FakeRuns(["n1", "n2"], [raised]))
    assert records(tmp_path) == []


def test_the_services_restart_request_restarts_that_run_only(tmp_path: Path) -> None:
    class Hung(FakeRun):
        def ended(self) -> RunEnd | None:
            return None if not self.stopped else RunEnd(ok=True)

    class HungOnce(FakeRuns):
        def start(self, spec_path: Path, run: int, hosts: list[str]) -> FakeRun:
            self.started.append((run, hosts, None))
            return Hung(RunEnd(ok=True)) if run == 0 else FakeRun(RunEnd(ok=True))

    request = {"attempt": 1, "run": 0, "cause": "hang", "detail": "no progress for 2 min"}
    (tmp_path / "restart-request.json").write_text(json.dumps(request))
    runs = HungOnce(["n1", "n2"], [])
    supervise(make_spec(tmp_path), runs)
    assert [run for run, _, _ in runs.started] == [0, 1]
    [record] = records(tmp_path)
    assert (record["cause"], record["detail"]) == ("hang", "no progress for 2 min")
    assert not (tmp_path / "restart-request.json").exists()


def test_a_cancelled_run_is_not_restarted(tmp_path: Path) -> None:
    cancelled = RunEnd(ok=False, cancelled=True, detail="cancelled")
    with pytest.raises(AttemptCancelled):
        supervise(make_spec(tmp_path), FakeRuns(["n1", "n2"], [cancelled]))


NODES = {0: "n1", 1: "n1", 2: "n2"}


def test_a_rank_killed_by_a_signal_is_lost_before_its_peers_lost_peer_errors(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    write_error(spec.files.error(0), 1, GLOO_LOST_PEER)
    end = classify({0: 1, 1: -9}, spec.files, 1, NODES)
    assert (end.cause, end.rank, end.node, end.detail) == ("node_failure", 1, "n1", "killed by SIGKILL")


def test_a_rank_that_raised_or_exited_by_itself_is_the_jobs_failure(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    write_error(spec.files.error(2), 1, "Traceback ...\nValueError: bad batch")
    write_error(spec.files.error(0), 1, GLOO_LOST_PEER)
    end = classify({0: 1, 2: 1}, spec.files, 1, NODES)
    assert (end.cause, end.rank, end.detail) == ("failure", 2, "ValueError: bad batch")
    exited = classify({1: 7}, make_spec(tmp_path / "other").files, 1, NODES)
    assert (exited.cause, exited.rank, exited.detail) == ("failure", 1, "exit code 7 without a traceback")


def test_a_rank_that_raised_is_the_failure_though_the_peer_it_left_exited_first(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    write_error(spec.files.error(1), 1, "Traceback ...\nRuntimeError: boom")  # still tearing down
    write_error(spec.files.error(0), 1, GLOO_LOST_PEER)
    end = classify({0: 1}, spec.files, 1, NODES)  # only the peer has exited yet
    assert (end.cause, end.rank, end.detail) == ("failure", 1, "RuntimeError: boom")


def test_an_old_attempts_error_file_and_a_cancel_tell_nothing_of_a_loss(tmp_path: Path) -> None:
    spec = make_spec(tmp_path)
    write_error(spec.files.error(1), 0, "ValueError: from attempt 0")  # not this attempt's
    assert classify({0: 130, 1: 130}, spec.files, 1, NODES).cancelled
    lost = classify({0: 1}, spec.files, 1, NODES)
    write_error(spec.files.error(0), 1, GLOO_LOST_PEER)
    assert classify({0: 1}, spec.files, 1, NODES).cause == "node_failure" and lost.cause == "failure"
