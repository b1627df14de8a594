"""SlurmBackend's status, cancel and validate against a fake command line: how many scheduler calls,
what they ask, and the backoff when the controller fails or is slow."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path

import pytest

from service.backends.slurm import SlurmBackend
from service.backends.slurm_commands import SLOW_CALL_S, CommandResult
from service.config import Settings
from service.errors import BackendError, InvalidRequest
from service.jobfs import log_file
from service.states import JobState
from tests.unit.backends.slurm_fakes import FakeCommands, fail, ok, recorded
from worker.spec import RunSpec

UNREACHABLE = "squeue: error: Unable to contact slurm controller (connect failure)\n"


def backend(commands: FakeCommands, tmp_path: Path) -> SlurmBackend:
    return SlurmBackend(
        Settings(data_dir=tmp_path), runner=commands, clock=commands.now, programs=commands.program
    )


def running_rows(argv: Sequence[str]) -> CommandResult:
    """squeue's answer: every id asked for is RUNNING on n1."""
    ids = next(arg for arg in argv if arg.startswith("--jobs=")).removeprefix("--jobs=").split(",")
    return ok("".join(f"{one}|RUNNING|None|0|0|n1\n" for one in ids))


def spec(tmp_path: Path, **resources: object) -> RunSpec:
    return RunSpec.model_validate(
        {
            "job_id": 1,
            "name": "j",
            "entrypoint": "worker.tasks.faults:hostnames",
            "folder": str(tmp_path / "j"),
            "resources": resources,
        }
    )


def test_building_the_backend_asks_nothing(commands: FakeCommands, tmp_path: Path) -> None:
    slurm = backend(commands, tmp_path)
    assert slurm.scheduler_calls == 0 and commands.calls == []
    assert slurm.poll([]) == {}
    slurm.cancel([])
    assert slurm.scheduler_calls == 0


def test_poll_of_200_jobs_is_one_scheduler_call(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", running_rows)
    slurm = backend(commands, tmp_path)
    ids = [str(1000 + n) for n in range(150)] + [f"77_{n}" for n in range(50)]
    statuses = slurm.poll(ids)
    assert slurm.scheduler_calls == 1
    assert set(statuses) == set(ids)
    assert all(s.state is JobState.running and s.nodes == "n1" for s in statuses.values())
    (argv,) = commands.calls
    assert argv[:6] == ["/opt/slurm/bin/squeue", "-h", "-t", "all", "-r", "-O"]
    assert argv[-1] == "--jobs=" + ",".join(ids)


def test_very_long_id_lists_are_chunked(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", running_rows)
    slurm = backend(commands, tmp_path)
    assert len(slurm.poll([str(n) for n in range(1, 12001)])) == 12000
    assert slurm.scheduler_calls == 3  # 5000 + 5000 + 2000


def test_jobs_squeue_forgot_are_asked_of_sacct_once(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", ok("10|RUNNING|None|0|0|n2\n"))
    commands.on("sacct", ok(recorded("sacct_final.txt")))
    slurm = backend(commands, tmp_path)
    statuses = slurm.poll(["10", "24", "35_2", "26_1", "999"])
    assert slurm.scheduler_calls == 2
    (argv,) = commands.named("sacct")
    assert argv[-1] == "--jobs=24,35,26,999"  # array elements by their array's id: "35_[0-3]" is one row
    assert statuses["10"].state is JobState.running
    assert (statuses["24"].state, statuses["24"].exit_code) == (JobState.failed, 3)
    assert statuses["35_2"].state is JobState.cancelled
    assert (statuses["26_1"].state, statuses["26_1"].exit_code) == (JobState.failed, 1)
    assert "999" not in statuses  # nobody knows it: absent, asked again next time


def test_an_array_cancelled_before_it_split_is_one_bare_row_for_all_its_elements(
    commands: FakeCommands, tmp_path: Path
) -> None:
    # Real output: two arrays of 100 cancelled while every element waited; neither squeue nor sacct
    # lists an element, sacct has one row per array under its bare id.
    commands.on("squeue", ok(recorded("squeue_array_cancelled_unsplit.txt")))
    commands.on("sacct", ok(recorded("sacct_array_cancelled_unsplit.txt")))
    statuses = backend(commands, tmp_path).poll(["62530_0", "62530_99", "62533_7", "62534_0"])

    (argv,) = commands.named("sacct")
    assert argv[-1] == "--jobs=62530,62533,62534"
    assert {one: status.state for one, status in statuses.items()} == {
        "62530_0": JobState.cancelled,
        "62530_99": JobState.cancelled,
        "62533_7": JobState.cancelled,
    }  # 62534 has no row at all: still unknown, asked again next time


def test_one_unknown_id_is_an_empty_squeue_not_a_failure(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", fail(recorded("squeue_unknown.txt")))
    commands.on("sacct", ok(""))
    slurm = backend(commands, tmp_path)
    assert slurm.poll(["999999"]) == {}
    assert slurm.controller_backoff.remaining() == 0


def test_controller_failure_backs_off(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", fail(UNREACHABLE), fail(UNREACHABLE), running_rows)
    slurm = backend(commands, tmp_path)
    with pytest.raises(BackendError, match="Unable to contact slurm controller"):
        slurm.poll(["1"])
    assert slurm.scheduler_calls == 1
    with pytest.raises(BackendError, match="not asking SLURM for 2 s more"):
        slurm.poll(["1"])  # within the backoff: refused at once, no call
    assert slurm.scheduler_calls == 1
    commands.clock += 2.1
    with pytest.raises(BackendError):
        slurm.poll(["1"])  # fails again: the next wait doubles
    assert slurm.scheduler_calls == 2
    commands.clock += 2.1
    with pytest.raises(BackendError, match="not asking"):
        slurm.poll(["1"])
    commands.clock += 2.0
    assert slurm.poll(["1"])["1"].state is JobState.running
    assert slurm.scheduler_calls == 3
    assert slurm.controller_backoff.remaining() == 0  # success resets it


def test_a_slow_controller_is_given_a_breather(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", running_rows)
    commands.call_seconds = SLOW_CALL_S + 2
    slurm = backend(commands, tmp_path)
    assert slurm.poll(["1"])["1"].state is JobState.running  # the answer still counts
    commands.call_seconds = 0
    with pytest.raises(BackendError, match=r"took 12\.0 s"):
        slurm.poll(["1"])
    commands.clock += SLOW_CALL_S + 2
    assert slurm.poll(["1"])
    assert slurm.scheduler_calls == 2


def test_a_timeout_is_a_backend_error(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", subprocess.TimeoutExpired(["squeue"], 30))
    with pytest.raises(BackendError, match="did not answer"):
        backend(commands, tmp_path).poll(["1"])


def test_missing_commands_are_a_backend_error(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("squeue", FileNotFoundError(2, "No such file or directory", "squeue"))
    with pytest.raises(BackendError, match="cannot run squeue"):
        backend(commands, tmp_path).poll(["1"])


def test_accounting_down_keeps_the_squeue_answers(commands: FakeCommands, tmp_path: Path) -> None:
    down = "sacct: error: slurm_persist_conn_open_without_init: failed to open persistent connection\n"
    commands.on("squeue", ok("10|RUNNING|None|0|0|n2\n"))
    commands.on("sacct", fail(down))
    slurm = backend(commands, tmp_path)
    assert set(slurm.poll(["10", "11"])) == {"10"}
    assert set(slurm.poll(["10", "11"])) == {"10"}  # sacct is under its own backoff now
    assert len(commands.named("sacct")) == 1 and len(commands.named("squeue")) == 2


def test_cancel_is_one_scancel_and_idempotent(commands: FakeCommands, tmp_path: Path) -> None:
    gone = (
        "scancel: error: Kill job error on job id 5: Invalid job id specified\n"
        "scancel: error: Kill job error on job id 6: Job/step already completing or completed\n"
    )
    commands.on("scancel", ok(recorded("scancel_finished_and_unknown.txt")), fail(gone))
    slurm = backend(commands, tmp_path)
    slurm.cancel(["5", "6", "7_1", "5"])
    assert commands.calls == [["/opt/slurm/bin/scancel", "--", "5", "6", "7_1"]]
    slurm.cancel(["5", "6"])  # older SLURM complains about unknown and finished ids: still fine
    assert slurm.scheduler_calls == 2


def test_no_value_but_an_id_reaches_a_scheduler_command(commands: FakeCommands, tmp_path: Path) -> None:
    """An id comes after `--` (scancel) or inside `--jobs=` (squeue, sacct), and only an id's shape
    goes at all: `--user=bob` from a job folder would otherwise be an option of a root scancel."""
    commands.on("scancel", ok())
    commands.on("squeue", ok("5|RUNNING|None|0|0|n1\n"))
    commands.on("sacct", ok())
    slurm = backend(commands, tmp_path)

    slurm.cancel(["5", "--user=bob", "-j", "7_1"])
    statuses = slurm.poll(["5", "--user=bob", "6\u00b2"])

    assert commands.named("scancel") == [["/opt/slurm/bin/scancel", "--", "5", "7_1"]]
    (squeue,) = commands.named("squeue")
    assert squeue[-1] == "--jobs=5" and "--user=bob" not in squeue
    assert set(statuses) == {"5"}
    assert all(argv[0].startswith("/") for argv in commands.calls)


def test_cancel_fails_when_the_controller_does(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("scancel", fail("scancel: error: Unable to contact slurm controller (connect failure)\n"))
    with pytest.raises(BackendError, match="Unable to contact"):
        backend(commands, tmp_path).cancel(["5"])


def test_validate_refusal_names_the_field(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("sbatch", fail(recorded("sbatch_too_many_nodes.txt")))
    slurm = backend(commands, tmp_path)
    with pytest.raises(InvalidRequest) as caught:
        slurm.validate(spec(tmp_path, nodes=3, tasks_per_node=2, timeout_min=5))
    assert caught.value.field == "resources.nodes"
    assert caught.value.message == "SLURM refuses this request: Node count specification invalid"
    (argv,) = commands.calls
    assert argv[:2] == ["/opt/slurm/bin/sbatch", "--test-only"]
    assert {"--nodes=3", "--ntasks-per-node=2", "--time=5", "--wrap=true"} <= set(argv)


def test_validate_answers_are_cached_per_shape(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("sbatch", ok(stderr=recorded("sbatch_test_ok.txt")))
    slurm = backend(commands, tmp_path)
    for _ in range(3):
        slurm.validate(spec(tmp_path, nodes=2))
    assert slurm.scheduler_calls == 1
    slurm.validate(spec(tmp_path, nodes=1))
    assert slurm.scheduler_calls == 2
    commands.clock += 61  # the cache forgets after a minute: partition limits can change
    slurm.validate(spec(tmp_path, nodes=2))
    assert slurm.scheduler_calls == 3


def test_validate_passes_the_allow_listed_options(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("sbatch", ok())
    slurm = SlurmBackend(
        Settings(data_dir=tmp_path, slurm_partition="debug"),
        runner=commands,
        clock=commands.now,
        programs=commands.program,
    )
    slurm.validate(
        spec(tmp_path, account="physics", qos="high", constraint="a100|h100", mem_gb=1.5, gpus_per_node=2)
    )
    (argv,) = commands.calls
    assert {
        "--partition=debug",
        "--account=physics",
        "--qos=high",
        "--constraint=a100|h100",
        "--mem=1536M",
        "--gpus-per-node=2",
    } <= set(argv)


def test_validate_cannot_reach_the_controller(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("sbatch", fail("sbatch: error: Batch job submission failed: Socket timed out on send/recv\n"))
    with pytest.raises(BackendError, match="cannot reach SLURM"):
        backend(commands, tmp_path).validate(spec(tmp_path))


def test_log_paths_follow_submitit(commands: FakeCommands, tmp_path: Path) -> None:
    slurm = backend(commands, tmp_path)
    assert slurm.log_path(tmp_path, "39", 3) == tmp_path / "submitit" / "39_3_log.out"
    assert slurm.log_path(tmp_path, "40_2", 0, "err") == tmp_path / "submitit" / "40_2_0_log.err"
    assert slurm.log_path(tmp_path, "40_2", 0, "err") == log_file(tmp_path, "40_2", 0, "err")
