"""The SLURM state table: every word SLURM prints has a home, and the homes are the right ones."""

from __future__ import annotations

import pytest

from service.backends.slurm_states import SLURM_STATES, UnknownSlurmState, map_slurm_state
from service.states import JobState, is_terminal

# Every word of job_state_string() in SLURM 22.05 (src/common/slurm_protocol_defs.c): 12 base states
# and 12 flags that are printed instead of the base state while they are set.
SLURM_22_05_WORDS = [
    "PENDING",
    "RUNNING",
    "SUSPENDED",
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "COMPLETING",
    "STAGE_OUT",
    "CONFIGURING",
    "RESIZING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "SPECIAL_EXIT",
    "STOPPED",
    "REVOKED",
    "RESV_DEL_HOLD",
    "SIGNALING",
]


@pytest.mark.parametrize("word", SLURM_22_05_WORDS)
def test_every_word_slurm_prints_is_mapped(word: str) -> None:
    state, _ = map_slurm_state(word)
    assert isinstance(state, JobState)
    assert state is not JobState.queued and state is not JobState.submitted  # those are ours alone


@pytest.mark.parametrize(
    ("word", "state", "reason"),
    [
        ("PENDING", JobState.pending, None),
        ("CONFIGURING", JobState.pending, "configuring (nodes booting)"),
        ("RUNNING", JobState.running, None),
        ("COMPLETING", JobState.running, "completing"),
        ("COMPLETED", JobState.succeeded, None),
        ("FAILED", JobState.failed, None),
        ("TIMEOUT", JobState.timeout, None),
        ("DEADLINE", JobState.timeout, "deadline reached"),
        ("NODE_FAIL", JobState.failed, "node failure"),
        ("BOOT_FAIL", JobState.failed, "node boot failure"),
        ("OUT_OF_MEMORY", JobState.failed, "out of memory"),
        ("CANCELLED", JobState.cancelled, None),
        ("SUSPENDED", JobState.preempted, "suspended"),
    ],
)
def test_mapping(word: str, state: JobState, reason: str | None) -> None:
    assert map_slurm_state(word) == (state, reason)


@pytest.mark.parametrize(
    "word", ["PREEMPTED", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SUSPENDED", "STOPPED"]
)
def test_preemption_and_requeue_are_not_failures(word: str) -> None:
    state, _ = map_slurm_state(word)
    assert state in (JobState.preempted, JobState.requeued)
    assert not is_terminal(state)


def test_cancelled_by_keeps_who() -> None:
    assert map_slurm_state("CANCELLED by 0") == (JobState.cancelled, "cancelled by uid 0")
    assert map_slurm_state("CANCELLED by 1234") == (JobState.cancelled, "cancelled by uid 1234")


def test_case_blanks_and_truncation_marks_are_ignored() -> None:
    assert map_slurm_state("  running \n") == (JobState.running, None)
    assert map_slurm_state("NODE_FAIL+") == (JobState.failed, "node failure")


def test_unknown_word_is_refused_not_guessed() -> None:
    with pytest.raises(UnknownSlurmState, match="WIBBLE"):
        map_slurm_state("WIBBLE")


def test_only_completed_means_success() -> None:
    assert [word for word, (state, _) in SLURM_STATES.items() if state is JobState.succeeded] == ["COMPLETED"]
