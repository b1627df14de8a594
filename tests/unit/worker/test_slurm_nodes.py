"""worker.slurm_nodes on what the test cluster printed (tests/data/slurm/), and through real processes
standing in for squeue and sinfo beside a fake srun (the calls, their timeout and their failures)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.support import ROOT
from worker.slurm_nodes import (
    SlurmQueryError,
    allocation_hosts,
    is_usable,
    node_states,
    scheduler_program,
    select_usable,
    usable_hosts,
)

DATA = ROOT / "tests" / "data" / "slurm"
HOSTS = ["n1", "n2", "n3"]


def recorded(name: str) -> str:
    return (DATA / name).read_text()


def test_allocation_hosts_is_the_whole_allocation_batch_host_first() -> None:
    # Recorded in a batch script of `sbatch --nodes=3 --no-kill`; it does not shrink when a node is lost.
    assert allocation_hosts({"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NODELIST": "n[1-3]"}) == HOSTS
    assert allocation_hosts({"SLURM_NODELIST": "gpu[07-08],cpu1"}) == ["gpu07", "gpu08", "cpu1"]
    assert allocation_hosts({}) == []
    with pytest.raises(ValueError):
        allocation_hosts({"SLURM_JOB_NODELIST": "n[1-"})


def test_scheduler_programs_sit_beside_srun() -> None:
    srun = {"TORCHYARD_SRUN": "/opt/slurm/bin/srun"}
    assert scheduler_program("sinfo", srun) == Path("/opt/slurm/bin/sinfo")
    for environ in ({}, {"TORCHYARD_SRUN": "srun"}, {"TORCHYARD_SRUN": ""}):
        with pytest.raises(ValueError, match="TORCHYARD_SRUN"):
            scheduler_program("sinfo", environ)


@pytest.mark.parametrize(
    ("state", "usable"),
    [("idle", True), ("mixed", True), ("allocated", True), ("completing", True), ("planned", True),
     ("mixed-", True), ("down*", False), ("down", False), ("drained", False), ("draining", False),
     ("fail", False), ("failing", False), ("idle*", False), ("mixed*", False), ("idle~", False),
     ("idle#", False), ("allocated@", False), ("maint", False), ("unknown", False), ("", False)],
)  # fmt: skip
def test_node_states_that_take_a_step(state: str, usable: bool) -> None:
    assert is_usable(state) is usable


def test_node_states_parse_sinfo_lines() -> None:
    assert node_states(recorded("sinfo_nodes_lost.txt")) == {"n1": "mixed", "n2": "down*", "n3": "mixed"}
    # A node in two partitions prints twice; junk lines (a warning on stdout, a bad name) are skipped.
    assert node_states("n1 idle\nn1 idle\nwarning: something odd here\n-x idle\n") == {"n1": "idle"}


def test_a_lost_node_that_came_back_idle_is_still_left_out() -> None:
    """scontrol's `state=down` on a node whose slurmd answers: ReturnToService=2 makes it idle again
    within 50 ms, but the allocation (--no-kill) no longer holds it. Only squeue's NodeList tells."""
    sinfo = "n1 mixed\nn2 idle\nn3 mixed\n"  # recorded just after n2 was marked down
    assert select_usable(HOSTS, recorded("squeue_nodelist_resized.txt"), sinfo) == ["n1", "n3"]


def test_a_dead_or_drained_node_still_in_the_allocation_is_left_out() -> None:
    assert select_usable(HOSTS, "n[1-3]\n", recorded("sinfo_nodes_lost.txt")) == ["n1", "n3"]
    assert select_usable(HOSTS, "n[1-3]\n", recorded("sinfo_nodes_drained.txt")) == ["n1", "n2"]
    assert select_usable(["n3", "n1"], "n[1-3]\n", "n1 idle\nn3 idle\n") == ["n3", "n1"]  # order kept
    assert select_usable(HOSTS, "n[1-3]\n", "n1 idle\n") == ["n1"]  # sinfo silent about a node: unknown
    assert select_usable(HOSTS, "", "n1 idle\nn2 idle\nn3 idle\n") == []


def _fake_bin(tmp_path: Path, squeue: str, sinfo: str) -> dict[str, str]:
    """A folder with srun, squeue and sinfo shell scripts; each call's arguments are logged."""
    for name, body in (("srun", "exit 0"), ("squeue", squeue), ("sinfo", sinfo)):
        path = tmp_path / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/calls\n{body}\n')
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return {"TORCHYARD_SRUN": str(tmp_path / "srun"), "PATH": "/nonexistent"}


def test_usable_hosts_asks_squeue_and_sinfo_beside_srun(tmp_path: Path) -> None:
    environ = _fake_bin(tmp_path, "echo 'n[1,3]'", "printf 'n1 mixed\\nn2 idle\\nn3 mixed\\n'")
    assert usable_hosts(HOSTS, "15", environ) == ["n1", "n3"]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls == ["squeue -h --jobs=15 -o %N", "sinfo -h -N --nodes=n1,n2,n3 -o %N %T"]


def test_usable_hosts_says_why_a_call_failed(tmp_path: Path) -> None:
    environ = _fake_bin(tmp_path, "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", "")
    with pytest.raises(SlurmQueryError, match=r"squeue failed \(exit status 1\): slurm_load_jobs error"):
        usable_hosts(HOSTS, "99999", environ)
    environ = _fake_bin(tmp_path, "echo n1", "sleep 5")
    with pytest.raises(SlurmQueryError, match="sinfo took more than"):
        usable_hosts(["n1"], "15", environ, timeout_s=0.5)
    with pytest.raises(SlurmQueryError, match="cannot run"):
        usable_hosts(["n1"], "15", {"TORCHYARD_SRUN": str(tmp_path / "none" / "srun")})


def test_usable_hosts_refuses_what_could_become_an_option() -> None:
    environ = {"TORCHYARD_SRUN": "/usr/bin/srun"}
    with pytest.raises(ValueError, match="job id"):
        usable_hosts(HOSTS, "15 --all", environ)
    with pytest.raises(ValueError, match="host names"):
        usable_hosts(["n1", "--all"], "15", environ)
    assert usable_hosts([], "15", environ) == []
