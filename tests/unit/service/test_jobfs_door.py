"""The job folder has one door (service.jobfs): the one module that opens without following links, and
the one builder of submitit's log names (which retention's matcher keeps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.jobfs.names import LOG_NAME, log_file, log_name
from worker.spec import JobFiles

SERVICE = Path(__file__).resolve().parents[3] / "service"


def modules_saying(word: str) -> set[str]:
    return {
        str(path.relative_to(SERVICE.parent))
        for path in SERVICE.rglob("*.py")
        if word in path.read_text(encoding="utf-8")
    }


def test_only_the_handles_module_opens_without_following_links() -> None:
    assert modules_saying("O_NOFOLLOW") == {"service/jobfs/handles.py"}


def test_nothing_outside_the_door_steps_below_a_folder_handle() -> None:
    outside = {module for module in modules_saying("dir_fd") if not module.startswith("service/jobfs/")}
    assert outside == set()


@pytest.mark.parametrize(("external_id", "rank", "stream"), [("39", 3, "out"), ("40_2", 0, "err")])
def test_retention_keeps_every_log_the_one_builder_names(external_id: str, rank: int, stream: str) -> None:
    name = log_name(external_id, rank, stream)
    assert name == f"{external_id}_{rank}_log.{stream}"
    assert LOG_NAME.fullmatch(name)
    assert log_file(Path("/jobs/7"), external_id, rank, stream) == JobFiles(Path("/jobs/7")).submitit / name


@pytest.mark.parametrize("name", ["spec.json", "error-rank0.txt", "39_0_log.out.tmp", "_log.out"])
def test_retention_keeps_no_other_name_as_a_log(name: str) -> None:
    assert not LOG_NAME.fullmatch(name)
