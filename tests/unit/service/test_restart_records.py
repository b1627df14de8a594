"""restarts.jsonl through the one door (service.jobfs.restarts): complete lines only, hostile lines
skipped (huge, NaN, NUL, not a record), an offset that moves past them; restart-request.json written
whole and never through a link; a restart's words (service.domain.restarts); a give-up in the ending."""

from __future__ import annotations

import json
import os
from pathlib import Path

from service.domain import restarts
from service.domain.endings import Ending, given_up
from service.jobfs.restarts import (
    MAX_RESTARTS_READ,
    read_new_restarts,
    read_restart_request,
    write_restart_request,
)
from service.ledger.models.jobs import Job
from service.states import JobState
from worker.spec import JobFiles, RestartRecord, RestartRequest

RECORD = {"attempt": 1, "restart": 1, "outcome": "restarted", "cause": "node_failure", "rank": 1,
          "node": "n2", "detail": "node down", "lost_at": 100.0, "started_at": 106.2, "resumed_step": 40,
          "resumed_from": "/j/ckpt-40.pt", "nodes": ["n1", "n3"], "max": 2}  # fmt: skip


def test_complete_lines_are_read_and_hostile_ones_skipped(tmp_path: Path) -> None:
    path = tmp_path / "restarts.jsonl"
    lines = [
        "x" * 20_000,
        '{"attempt": 1, "restart": 1, "outcome": "restarted", "cause": "node_failure", "lost_at": NaN}',
        json.dumps({**RECORD, "detail": "a\u0000b", "node": "n\n2"}),
        "null",
        json.dumps({**RECORD, "cause": "boredom"}),
    ]
    path.write_text("\n".join(lines) + "\n" + json.dumps(RECORD)[:30])  # a torn last line
    records, offset = read_new_restarts(path, 0) or ([], 0)
    assert [(r.restart, r.lost_at, r.detail, r.node) for r in records] == [
        (1, None, "", None),
        (1, 100.0, "ab", None),
    ]
    assert offset == len("\n".join(lines)) + 1
    assert read_new_restarts(path, offset) is None  # only the torn line: wait for its end


def test_a_line_longer_than_a_whole_read_is_passed_over(tmp_path: Path) -> None:
    path = tmp_path / "restarts.jsonl"
    path.write_bytes(b"y" * (MAX_RESTARTS_READ + 10) + b"\n" + json.dumps(RECORD).encode() + b"\n")
    first = read_new_restarts(path, 0)
    assert first == ([], MAX_RESTARTS_READ)
    records, _ = read_new_restarts(path, first[1]) or ([], 0)
    assert [r.restart for r in records] == [1]


def test_a_link_is_not_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text(json.dumps(RECORD) + "\n")
    (tmp_path / "restarts.jsonl").symlink_to(secret)
    assert read_new_restarts(tmp_path / "restarts.jsonl", 0) is None


def test_the_request_is_written_whole_over_the_old_one_and_over_a_link_never_through_it(
    tmp_path: Path,
) -> None:
    files = JobFiles(tmp_path / "job")
    files.folder.mkdir()
    target = tmp_path / "victim"
    target.write_text("keep")
    files.restart_request.symlink_to(target)
    write_restart_request(files, RestartRequest(attempt=1, run=0, cause="hang", detail="stuck"))
    assert target.read_text() == "keep" and not files.restart_request.is_symlink()
    write_restart_request(files, RestartRequest(attempt=1, run=1, cause="hang"))
    assert read_restart_request(files) == RestartRequest(attempt=1, run=1, cause="hang")
    assert sorted(os.listdir(files.folder)) == ["restart-request.json"]  # no temporary left


def test_a_restart_in_words() -> None:
    record = RestartRecord.model_validate(RECORD)
    assert restarts.describe(record, 2) == (
        "rank 1 on n2 lost (node down); restarted in place on n1,n3 in 6.2 s from step 40, restart 1 of 2"
    )
    fresh = record.model_copy(
        update={"resumed_step": None, "resumed_from": None, "cause": "hang", "detail": ""}
    )
    assert (
        restarts.describe(fresh, 3)
        == "stalled (hang); restarted in place on n1,n3 in 6.2 s from the start, restart 1 of 3"
    )


def test_the_log_counts_the_current_attempts_restarts_and_stays_bounded() -> None:
    log: restarts.Log = []
    for attempt, restart in [(1, 1), (1, 2), (2, 1)]:
        log = restarts.appended(log, {"attempt": attempt, "restart": restart, "outcome": "restarted"})
    assert (
        restarts.runs_seen(log, 1) == 2
        and restarts.runs_seen(log, 2) == 1
        and restarts.runs_seen(log, 3) == 0
    )
    for n in range(restarts.MAX_LOG + 5):
        log = restarts.appended(log, {"attempt": 3, "restart": n + 1, "outcome": "restarted"})
    assert len(log) == restarts.MAX_LOG and log[-1]["restart"] == restarts.MAX_LOG + 5


def test_a_give_up_names_itself_in_the_ending_and_takes_the_losss_kind() -> None:
    job = Job(name="j", backend="slurm", spec={}, attempt=1)
    job.restart_log = [{"attempt": 1, "restart": 2, "outcome": "gave_up", "cause": "node_failure",
                        "rank": 1, "node": "n2", "detail": "killed by SIGKILL",
                        "reason": "restarts spent (2 of 2)"}]  # fmt: skip
    plain = given_up(job, Ending(JobState.failed, "failure", "ended without a result (exit code 1)"))
    assert plain.kind == "node_failure"
    assert plain.reason == (  # the files say nothing of the loss: the supervisor's word names it
        "rank 1 on n2 lost (killed by SIGKILL); not restarted in place: restarts spent (2 of 2)\n"
        "ended without a result (exit code 1)"
    )
    own = given_up(job, Ending(JobState.failed, "failure", "rank 0 raised:\nValueError"))
    assert own.kind == "failure"
    assert own.reason.endswith("\n(not restarted in place: restarts spent (2 of 2))")
    done = Ending(JobState.succeeded, None, "completed")
    assert given_up(job, done) is done
    job.attempt = 2  # another attempt's give-up says nothing of this one
    assert given_up(job, plain).reason == plain.reason
