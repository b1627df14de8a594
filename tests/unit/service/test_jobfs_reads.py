"""The service's readers of a job folder follow no link the job planted, in its own folders either: a
job can swap `placement/` or `submitit/` for a link to another job's, which the service (root) could
read and the job could not; and only a file the service made names the job's scheduler id."""

from __future__ import annotations

import os
import pwd
import tracemalloc
from pathlib import Path

import pytest

from service.jobfs.handles import open_below
from service.jobfs.reads import (
    MAX_PROGRESS_READ,
    log_tail,
    rank_errors,
    read_new_progress,
    read_placement,
    submitted_external_id,
)
from worker.spec import JobFiles

PLACEMENT = '{"rank": 0, "attempt": 1, "host": "victim-host", "local_rank": 0, "gpu": null}'


def job(root: Path, name: str) -> JobFiles:
    files = JobFiles(root / name)
    files.submitit.mkdir(parents=True)
    return files


def test_a_placement_folder_swapped_for_a_link_is_not_read(tmp_path: Path) -> None:
    victim, attacker = job(tmp_path, "2"), job(tmp_path, "3")
    victim.placement(0).parent.mkdir()
    victim.placement(0).write_text(PLACEMENT)
    assert [one["host"] for one in read_placement(victim, 1, 1)] == ["victim-host"]

    attacker.placement(0).parent.symlink_to(victim.placement(0).parent, target_is_directory=True)

    assert read_placement(attacker, 1, 1) == []


def test_a_submitit_folder_swapped_for_a_link_gives_no_log(tmp_path: Path) -> None:
    victim, attacker = job(tmp_path, "2"), job(tmp_path, "3")
    (victim.submitit / "7_0_log.err").write_text("the victim's secret\n")
    os.rmdir(attacker.submitit)
    attacker.submitit.symlink_to(victim.submitit, target_is_directory=True)

    assert log_tail(attacker.folder, attacker.submitit / "7_0_log.err") == ""
    assert log_tail(victim.folder, victim.submitit / "7_0_log.err") == "the victim's secret"


def test_a_path_outside_the_folder_is_not_opened(tmp_path: Path) -> None:
    files = job(tmp_path, "2")
    (tmp_path / "elsewhere.txt").write_text("x")
    assert open_below(files.folder, tmp_path / "elsewhere.txt") is None
    assert open_below(files.folder, files.folder / ".." / "elsewhere.txt") is None


def test_only_a_pickle_the_service_made_names_the_scheduler_id(tmp_path: Path) -> None:
    files = job(tmp_path, "2")
    (files.submitit / "41_submitted.pkl").write_bytes(b"")
    assert submitted_external_id(files) == "41"

    (files.submitit / "41_submitted.pkl").unlink()
    (files.submitit / "41_submitted.pkl").symlink_to(tmp_path / "elsewhere.pkl")
    assert submitted_external_id(files) is None  # a link is nobody's pickle


@pytest.mark.parametrize("name", ["--user=bob", "41;42", "\u00b2", "4_1_2", "-1", "41 ", "1" * 19])
def test_a_name_the_job_gave_the_services_pickle_is_no_id(tmp_path: Path, name: str) -> None:
    """The job's account can rename the service's `<id>_submitted.pkl` in its own folder: `--user=bob`
    would reach scancel as an option (and cancel all of bob's jobs as root)."""
    files = job(tmp_path, "2")
    (files.submitit / f"{name}_submitted.pkl").write_bytes(b"")  # the service's file, renamed

    assert submitted_external_id(files) is None


def test_an_array_element_s_pickle_names_its_id(tmp_path: Path) -> None:
    files = job(tmp_path, "2")
    (files.submitit / "41_7_submitted.pkl").write_bytes(b"")
    assert submitted_external_id(files) == "41_7"


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a file of another account needs root")
def test_a_pickle_the_jobs_account_planted_names_nothing(tmp_path: Path) -> None:
    files = job(tmp_path, "2")
    planted = files.submitit / "999_submitted.pkl"  # another user's SLURM job, to be cancelled as ours
    planted.write_bytes(b"")
    nobody = pwd.getpwnam("nobody")
    os.chown(planted, nobody.pw_uid, nobody.pw_gid)

    assert submitted_external_id(files) is None


def test_error_files_cost_a_bounded_read_however_many_and_large_the_job_made_them(tmp_path: Path) -> None:
    """Issue 35, finding 5: a job's sparse error files cost it no disk, and each was read up to 1 MiB
    and held: 20,000 of them were about 20 GiB in the root service, every tick."""
    files = job(tmp_path, "2")
    for rank in range(300):  # the world is 4: the others are nobody's
        with files.error(rank).open("wb") as sparse:
            sparse.write(b"attempt: 1\nTraceback (most recent call last):\n")
            sparse.truncate(1 << 30)
            sparse.seek((1 << 30) - 30)
            sparse.write(b"\nValueError: the real cause\n")

    tracemalloc.start()
    try:
        errors = rank_errors(files, 1, 4)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert [error.rank for error in errors] == [0, 1, 2, 3]
    assert all(error.text.endswith("ValueError: the real cause") for error in errors)
    assert peak < 1 << 20, f"{peak} bytes held to read four ranks' errors"


def test_a_progress_line_longer_than_a_whole_read_is_passed_over_not_waited_on(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    good = b'{"step": 1, "metrics": {"loss": 0.5}}\n'
    path.write_bytes(b"x" * (MAX_PROGRESS_READ + 10) + b"\n" + good)

    offset, seen = 0, []
    for _ in range(4):  # the long line costs reads of its own, never a wait
        read = read_new_progress(path, offset, most_metrics=100)
        assert read is not None, f"stuck at byte {offset}"
        records, offset = read
        seen += records
        if offset == path.stat().st_size:
            break

    assert offset == path.stat().st_size
    assert [record.step for record in seen] == [1]
    assert read_new_progress(path, offset, most_metrics=100) is None  # nothing new
