"""Parsing what the real scheduler printed (tests/data/slurm/, recorded by capture.sh on the test
cluster). The tests look records up by what they show, not by job id, so a new recording still fits."""

from __future__ import annotations

from datetime import timedelta

import pytest

from service.backends import slurm_parse as parse
from service.backends.base import BackendStatus
from service.states import JobState
from tests.unit.backends.slurm_fakes import DATA, recorded


def squeue(name: str) -> dict[str, BackendStatus]:
    return {key: parse.to_status(record) for key, record in parse.parse_squeue(recorded(name)).items()}


def sacct(name: str) -> dict[str, BackendStatus]:
    return {key: parse.to_status(record) for key, record in parse.parse_sacct(recorded(name)).items()}


def in_state(statuses: dict[str, BackendStatus], state: JobState) -> dict[str, BackendStatus]:
    return {key: status for key, status in statuses.items() if status.state is state}


def test_the_recorded_formats_are_the_ones_the_backend_asks_for() -> None:
    script = (DATA / "capture.sh").read_text()
    assert f"SQUEUE_FMT='{parse.SQUEUE_FORMAT}'" in script
    assert f"SACCT_FMT='{parse.SACCT_FORMAT}'" in script


def test_squeue_pending_reasons_are_kept() -> None:
    pending = in_state(squeue("squeue_mixed_array_expanded.txt"), JobState.pending)
    assert {status.reason for status in pending.values()} == {
        "Resources",
        "Priority",
        "Dependency",
        "JobHeldUser",
    }
    assert all(status.exit_code is None and status.nodes is None for status in pending.values())


def test_squeue_lists_each_element_of_a_pending_array() -> None:
    expanded = squeue("squeue_mixed_array_expanded.txt")
    compact = squeue("squeue_mixed.txt")  # without -r: one "35_[0-3]" row, expanded by the parser
    elements = sorted(key for key in expanded if "_" in key and expanded[key].state is JobState.pending)
    assert len(elements) == 4
    assert all(key in compact and compact[key] == expanded[key] for key in elements)


def test_squeue_running_jobs_carry_their_nodes() -> None:
    running = in_state(squeue("squeue_mixed.txt"), JobState.running)
    assert {status.nodes for status in running.values()} == {"n2", "n[1-2]"}
    assert all(status.reason is None for status in running.values())


def test_squeue_ended_jobs_decode_the_raw_wait_status() -> None:
    final = squeue("squeue_final.txt")
    failed = in_state(final, JobState.failed)
    assert sorted(s.exit_code for s in failed.values() if s.reason is None and s.exit_code is not None) == [
        1,
        2,
        3,
    ]  # 256, 512, 768
    assert [s.reason for s in failed.values() if s.reason] == ["node failure; signal 15 (SIGTERM)"]
    cancelled_running = [s for s in in_state(final, JobState.cancelled).values() if s.nodes]
    assert cancelled_running and all(s.reason == "signal 15 (SIGTERM)" for s in cancelled_running)
    assert all(s.exit_code == 0 for s in in_state(final, JobState.succeeded).values())
    assert len(in_state(final, JobState.timeout)) == 1


def test_squeue_after_a_requeue() -> None:
    # Right after `scontrol requeue` the job is COMPLETING; then PENDING again, only RestartCnt tells.
    (completing,) = squeue("squeue_requeuing.txt").values()
    assert (completing.state, completing.reason) == (JobState.running, "completing")
    (requeued,) = squeue("squeue_requeued.txt").values()
    assert requeued.state is JobState.requeued
    assert requeued.reason == "requeued (restart 1); BeginTime"


def test_squeue_suspended_is_preempted() -> None:
    (suspended,) = squeue("squeue_suspended.txt").values()
    assert (suspended.state, suspended.reason) == (JobState.preempted, "suspended")


def test_sacct_final_states() -> None:
    final = sacct("sacct_final.txt")
    assert sorted(
        s.exit_code for s in in_state(final, JobState.failed).values() if s.exit_code is not None
    ) == [0, 1, 2, 3]
    node_fail = [s for s in final.values() if s.reason == "node failure"]
    assert len(node_fail) == 1 and node_fail[0].state is JobState.failed
    cancelled = in_state(final, JobState.cancelled)
    assert {s.reason for s in cancelled.values()} == {"cancelled by uid 0"}  # "CANCELLED by 0"
    assert any(s.nodes is None for s in cancelled.values())  # "None assigned": never started
    assert len(in_state(final, JobState.timeout)) == 1


def test_sacct_expands_an_array_that_never_started() -> None:
    sizes: dict[str, int] = {}
    for key in sacct("sacct_final.txt"):
        if "_" in key:
            base = key.split("_")[0]
            sizes[base] = sizes.get(base, 0) + 1
    assert sorted(sizes.values()) == [3, 4]  # a 3-element array that ran; "35_[0-3]", cancelled pending


def test_sacct_does_not_know_pending_jobs_yet() -> None:
    # Why poll asks squeue first: these five were queued in squeue_mixed, sacct had none of them.
    queued = in_state(squeue("squeue_mixed.txt"), JobState.pending)
    assert queued and not set(queued) & set(sacct("sacct_mixed.txt"))


def test_sacct_requeued_and_suspended() -> None:
    assert [s.state for s in sacct("sacct_requeued.txt").values()] == [JobState.requeued]
    assert [s.state for s in sacct("sacct_suspended.txt").values()] == [JobState.preempted]


def test_sacct_skips_steps() -> None:
    text = "12|COMPLETED|0:0|None|n1\n12.batch|COMPLETED|0:0||n1\n12.0|FAILED|1:0||n1\n"
    assert list(parse.parse_sacct(text)) == ["12"]


@pytest.mark.parametrize(
    ("printed", "ids"),
    [
        ("7", ["7"]),
        ("7_3", ["7_3"]),
        ("35_[0-3]", ["35_0", "35_1", "35_2", "35_3"]),
        ("35_[0-2,5%4]", ["35_0", "35_1", "35_2", "35_5"]),
        ("35_[1,3-4%2]", ["35_1", "35_3", "35_4"]),
    ],
)
def test_expand_job_ids(printed: str, ids: list[str]) -> None:
    assert parse.expand_job_ids(printed) == ids


@pytest.mark.parametrize(
    ("name", "message", "field"),
    [
        ("sbatch_too_many_nodes.txt", "Node count specification invalid", "resources.nodes"),
        ("sbatch_submit_too_many_nodes.txt", "Node count specification invalid", "resources.nodes"),
        (
            "sbatch_bad_partition.txt",
            "invalid partition specified: nosuch; Invalid partition name specified",
            "resources.partition",
        ),
        (
            "sbatch_time_over_limit.txt",
            "Requested time limit is invalid (missing or exceeds some limit)",
            "resources.timeout_min",
        ),
        ("sbatch_too_many_tasks.txt", "More processors requested than permitted", "resources.tasks_per_node"),
    ],
)
def test_sbatch_refusals(name: str, message: str, field: str) -> None:
    text = parse.sbatch_error(recorded(name))
    assert text == message
    assert not parse.is_transient(text)
    assert parse.error_field(text) == field


def test_error_fields_for_other_refusals() -> None:
    assert (
        parse.error_field("More processors requested than permitted", cpus_per_task=4)
        == "resources.cpus_per_task"
    )
    assert (
        parse.error_field("Invalid account or account/partition combination specified") == "resources.account"
    )
    assert parse.error_field("Invalid qos specification") == "resources.qos"
    assert parse.error_field("Invalid feature specification") == "resources.constraint"
    assert parse.error_field("Requested node configuration is not available") == "resources"


def test_unreachable_controller_is_transient() -> None:
    stderr = (
        "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)\n"
    )
    assert parse.sbatch_error(stderr) == "Unable to contact slurm controller (connect failure)"
    assert parse.is_transient(parse.sbatch_error(stderr))


def test_sbatch_job_id() -> None:
    assert parse.parse_sbatch_job_id("123\n") == "123"
    assert parse.parse_sbatch_job_id("123;torchyard\n") == "123"
    assert parse.parse_sbatch_job_id("Submitted batch job 45\n") == "45"
    assert parse.parse_sbatch_job_id("sbatch: something odd\n") is None
    assert "to start at" in recorded("sbatch_test_ok.txt")  # --test-only succeeds on stderr, exit 0


def test_scontrol_config_values() -> None:
    config = recorded("scontrol_show_config.txt")
    assert parse.parse_config_value(config, "MaxArraySize") == "1001"
    assert parse.parse_config_value(config, "NoSuchKey") is None


def test_unknown_ids_are_an_empty_answer_not_a_failure() -> None:
    # squeue exits 1 for one unknown id (it prints nothing for several); scancel says nothing at all.
    assert "Invalid job id specified" in recorded("squeue_unknown.txt")
    assert recorded("scancel_finished_and_unknown.txt") == ""


@pytest.mark.parametrize(
    ("word", "left_queue", "state", "kind"),
    [
        ("NODE_FAIL", True, JobState.failed, "node_failure"),
        ("BOOT_FAIL", True, JobState.failed, "node_failure"),
        ("OUT_OF_MEMORY", True, JobState.failed, "oom"),
        ("PREEMPTED", True, JobState.failed, "preemption"),  # cancelled by preemption: an ending
        ("PREEMPTED", False, JobState.preempted, None),  # still in the queue: SLURM may requeue it
        ("FAILED", True, JobState.failed, None),  # the job's files tell why (service.domain.endings)
        ("TIMEOUT", True, JobState.timeout, None),
    ],
)
def test_the_endings_slurm_names_carry_their_kind(
    word: str, left_queue: bool, state: JobState, kind: str | None
) -> None:
    status = parse.to_status(parse.SchedulerRecord(state=word, left_queue=left_queue))
    assert (status.state, status.kind) == (state, kind)
    if word == "PREEMPTED" and left_queue:
        assert status.reason == "preempted, not requeued"


def test_squeue_brings_the_start_estimate_of_a_job_waiting_for_resources() -> None:
    # A job filling the cluster with a 5-minute limit, and three behind it (capture.sh).
    records = parse.parse_squeue(recorded("squeue_start_estimate.txt"))
    statuses = {key: parse.to_status(record) for key, record in records.items()}
    (blocker,) = (records[key] for key, s in statuses.items() if s.state is JobState.running)
    waiting = {s.reason: s for s in in_state(statuses, JobState.pending).values()}

    estimate = waiting["Resources"].expected_start
    assert blocker.start is not None and estimate is not None and estimate.tzinfo is not None
    assert estimate - blocker.start == timedelta(minutes=5)  # when the blocker's limit runs out
    # Behind the first in line, or held: SLURM has no estimate (N/A). A running job has none either.
    assert waiting["Priority"].expected_start is None and waiting["JobHeldUser"].expected_start is None
    assert all(s.expected_start is None for s in statuses.values() if s.state is JobState.running)


def test_squeue_recorded_before_start_times_parses_without_estimates() -> None:
    statuses = squeue("squeue_mixed.txt")  # six fields: recorded before StartTime was asked for
    assert in_state(statuses, JobState.pending) and all(s.expected_start is None for s in statuses.values())


# A --no-kill allocation of n[1-3] (capture: docs/slurm.md, "Lost nodes"), squeue's BatchHost last.
BATCH_HOST_LOST = "node n1, the batch host, was lost: SLURM ends the allocation with it"


def test_squeue_names_the_batch_host_that_slurm_lost() -> None:
    # `scontrol update nodename=n1 state=down` under the batch script: FAILED, JobLaunchFailure, signal
    # 9, NodeList without n1. Not NODE_FAIL, and not requeued by SLURM.
    (record,) = parse.parse_squeue(recorded("squeue_batch_host_lost.txt")).values()
    status = parse.to_status(record)
    assert (record.batch_host, record.nodes, record.lost_batch_host) == ("n1", "n[2-3]", "n1")
    assert (status.state, status.kind, status.lost_batch_host) == (JobState.failed, "node_failure", "n1")
    assert status.reason is not None and status.reason.startswith(BATCH_HOST_LOST)
    assert "signal 9 (SIGKILL)" in status.reason


def test_sacct_names_the_batch_host_from_the_row_before_the_resize() -> None:
    # Two rows for one job: RESIZING with the nodes it started with, then FAILED 0:9 without n1.
    (status,) = sacct("sacct_batch_host_lost.txt").values()
    assert (status.state, status.kind, status.lost_batch_host) == (JobState.failed, "node_failure", "n1")
    assert status.reason is not None and status.reason.startswith(BATCH_HOST_LOST)
    assert status.nodes == "n[2-3]"


@pytest.mark.parametrize("name", ["squeue_node_lost.txt", "sacct_node_lost.txt"])
def test_a_lost_node_that_is_not_the_batch_host_is_no_ending_of_its_own(name: str) -> None:
    # n2 marked down under a step: the allocation shrank to n[1,3] and the batch script went on.
    (status,) = (squeue(name) if name.startswith("squeue") else sacct(name)).values()
    assert (status.state, status.kind, status.lost_batch_host) == (JobState.succeeded, None, None)
    assert status.nodes == "n[1,3]"


def test_squeue_recorded_before_batch_hosts_names_none() -> None:
    records = parse.parse_squeue(recorded("squeue_start_estimate.txt"))  # seven fields
    assert records and all(r.batch_host is None and r.lost_batch_host is None for r in records.values())
    # A job that waits has no batch host yet: squeue prints "n/a" (recorded with --hold).
    (held,) = parse.parse_squeue("18|PENDING|JobHeldUser|0|0||N/A|n/a\n").values()
    assert held.batch_host is None
