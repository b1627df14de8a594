"""SlurmBackend.submit against a fake sbatch: the real submitit script and pickles, our arrays and
per-job folders, grouping, chunking under MaxArraySize, and how refusals are isolated."""

from __future__ import annotations

import itertools
import pickle
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from service.accounts import Account
from service.backends import slurm_submit
from service.backends.slurm import SlurmBackend
from service.backends.slurm_commands import CommandResult
from service.backends.slurm_request import share_throttle
from service.config import Settings
from service.errors import BackendError
from tests.support import wait_for
from tests.unit.backends.slurm_fakes import FakeCommands, fail, ok, recorded
from worker.launch import Supervisor
from worker.spec import ArrayGroup, RunSpec

REFUSED = (
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit)\n"
)
UNREACHABLE = (
    "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)\n"
)


class FakeSbatch:
    """Accepts scripts with ids 100, 101, ...; keeps each script's text."""

    def __init__(self) -> None:
        self.ids = itertools.count(100)
        self.scripts: list[str] = []

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        assert [Path(argv[0]).name, argv[1]] == ["sbatch", "--parsable"]
        self.scripts.append(Path(argv[2]).read_text())
        return ok(f"{next(self.ids)};torchyard\n")


def config(max_array_size: int = 1001) -> CommandResult:
    text = recorded("scontrol_show_config.txt").replace("= 1001", f"= {max_array_size}")
    return ok(text)


def make(tmp_path: Path, job_id: int, **resources: Any) -> RunSpec:
    return RunSpec.model_validate(
        {
            "job_id": job_id,
            "name": f"job-{job_id}",
            "entrypoint": "worker.tasks.faults:hostnames",
            "folder": str(tmp_path / "jobs" / str(job_id)),
            "resources": {"timeout_min": 5, **resources},
        }
    )


@pytest.fixture
def sbatch(commands: FakeCommands) -> FakeSbatch:
    fake = FakeSbatch()
    commands.on("scontrol", config())
    commands.on("sbatch", fake)
    return fake


def backend(commands: FakeCommands, tmp_path: Path) -> SlurmBackend:
    return SlurmBackend(
        Settings(data_dir=tmp_path / "data"), runner=commands, clock=commands.now, programs=commands.program
    )


def test_equal_jobs_go_out_as_one_array_with_per_job_folders(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    specs = [make(tmp_path, n) for n in (1, 2, 3)] + [make(tmp_path, 4, nodes=2, tasks_per_node=2)]
    outcomes = backend(commands, tmp_path).submit(specs)
    assert [(o.job_id, o.external_id, o.error) for o in outcomes] == [
        (1, "100_0", None),
        (2, "100_1", None),
        (3, "100_2", None),
        (4, "101", None),
    ]
    assert [Path(argv[0]).name for argv in commands.calls] == ["scontrol", "sbatch", "sbatch"]
    array, single = sbatch.scripts
    assert "#SBATCH --array=0-2%3" in array  # no throttle: the elements are independent jobs
    assert "#SBATCH --no-kill" in array and "#SBATCH --no-kill" in single  # a lost node: the job goes on
    assert "#SBATCH --nodes=2" in single and "#SBATCH --ntasks-per-node=2" in single
    (output,) = [line for line in array.splitlines() if line.startswith("#SBATCH --output=")]
    assert output.endswith("/%a/%A_%a_0_log.out")
    links = Path(output.split("=", 1)[1]).parent.parent
    for index, spec in enumerate(specs[:3]):
        assert (links / str(index)).resolve() == spec.files.submitit.resolve()
        pickled = spec.files.submitit / f"100_{index}_submitted.pkl"
        assert sorted(p.name for p in spec.files.submitit.iterdir()) == [pickled.name]  # its own only
        with pickled.open("rb") as handle:
            delayed = pickle.load(handle)
        assert isinstance(delayed.function, Supervisor) and delayed.function.spec == spec
    assert (specs[3].files.submitit / "101_submitted.pkl").exists()
    assert (specs[3].files.submitit / "101_submission.sh").exists()


def test_arrays_are_cut_under_max_array_size(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    commands.on("scontrol", config(max_array_size=2))
    slurm = backend(commands, tmp_path)
    outcomes = slurm.submit([make(tmp_path, n) for n in range(5)])
    assert [o.external_id for o in outcomes] == ["100_0", "100_1", "101_0", "101_1", "102"]
    slurm.submit([make(tmp_path, 9)])
    assert len(commands.named("scontrol")) == 1  # read once


def test_a_sweep_is_its_own_array_throttled_to_max_parallel(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    sweep = ArrayGroup(key="sweep-7", max_parallel=2)
    specs = [make(tmp_path, n).model_copy(update={"group": sweep}) for n in range(4)]
    outcomes = backend(commands, tmp_path).submit([*specs, make(tmp_path, 9)])  # job 9: not the sweep's
    assert [o.external_id for o in outcomes] == ["100_0", "100_1", "100_2", "100_3", "101"]
    assert "#SBATCH --array=0-3%2" in sbatch.scripts[0]


def test_a_sweep_cut_under_max_array_size_shares_its_throttle(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    commands.on("scontrol", config(max_array_size=4))
    sweep = ArrayGroup(key="sweep-7", max_parallel=5)
    specs = [make(tmp_path, n).model_copy(update={"group": sweep}) for n in range(10)]
    backend(commands, tmp_path).submit(specs)
    arrays = [line for script in sbatch.scripts for line in script.splitlines() if "--array" in line]
    assert arrays == ["#SBATCH --array=0-3%2", "#SBATCH --array=0-3%2", "#SBATCH --array=0-1%1"]
    assert share_throttle(None, 2) == [None, None]


def test_a_sweep_of_more_arrays_than_max_parallel_is_refused_before_any_sbatch(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    # Three arrays of %1 would run three trials of a sweep of max_parallel 2 at once. The claim never
    # hands over more than max_parallel arrays' worth (service.loops.sweep_claims, tested in
    # tests/api/test_sweeps.py); handed more anyway, the backend sends none of it.
    commands.on("scontrol", config(max_array_size=4))
    sweep = ArrayGroup(key="sweep-8", max_parallel=2)
    specs = [make(tmp_path, n).model_copy(update={"group": sweep}) for n in range(10)]

    with pytest.raises(ValueError, match="max_parallel"):
        backend(commands, tmp_path).submit(specs)

    assert sbatch.scripts == []
    assert all(list(spec.files.submitit.iterdir()) == [] for spec in specs)
    assert share_throttle(2, 2) == [1, 1]
    with pytest.raises(ValueError):
        share_throttle(2, 3)


def test_a_refused_sweep_array_is_not_split_into_unthrottled_jobs(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    commands.on("sbatch", fail(REFUSED), sbatch)
    sweep = ArrayGroup(key="sweep-3", max_parallel=1)
    specs = [make(tmp_path, n).model_copy(update={"group": sweep}) for n in (1, 2, 3)]
    outcomes = backend(commands, tmp_path).submit(specs)
    message = "Job violates accounting/QOS policy (job submit limit)"
    assert [(o.external_id, o.error) for o in outcomes] == [(None, message)] * 3
    assert len(commands.named("sbatch")) == 1  # not one by one, where max_parallel would not hold


def test_a_refused_array_is_retried_one_by_one(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    # The QOS lets one more job in: the array of three is refused, the first alone passes, then no more.
    commands.on("sbatch", fail(REFUSED), sbatch, fail(REFUSED))
    outcomes = backend(commands, tmp_path).submit([make(tmp_path, n) for n in (1, 2, 3)])
    message = "Job violates accounting/QOS policy (job submit limit)"
    assert [(o.external_id, o.error) for o in outcomes] == [("100", None), (None, message), (None, message)]
    assert len(commands.named("sbatch")) == 4  # the array, then each job alone


def test_same_refusal_alone_spares_the_other_calls(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    too_many = fail(recorded("sbatch_submit_too_many_nodes.txt"))
    commands.on("sbatch", too_many, too_many, sbatch)
    specs = [make(tmp_path, n, nodes=3) for n in range(10)] + [make(tmp_path, 99)]
    outcomes = backend(commands, tmp_path).submit(specs)
    assert {o.error for o in outcomes[:10]} == {"Node count specification invalid"}
    assert outcomes[10].external_id == "100"  # the good job of the same batch is not held back
    assert len(commands.named("sbatch")) == 3  # the array, its first job alone, the good one
    assert not list(specs[0].files.submitit.iterdir())  # the refused pickles are cleaned up


def test_unreachable_before_anything_was_accepted_fails_the_batch(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    commands.on("sbatch", fail(UNREACHABLE))
    specs = [make(tmp_path, 1), make(tmp_path, 2, nodes=2)]
    with pytest.raises(BackendError, match="unreachable"):
        backend(commands, tmp_path).submit(specs)
    assert len(commands.named("sbatch")) == 1  # not retried one by one: nobody can get through


def test_unreachable_after_some_were_accepted_keeps_them(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    commands.on("sbatch", sbatch, fail(UNREACHABLE))
    specs = [make(tmp_path, 1), make(tmp_path, 2, nodes=2), make(tmp_path, 3, nodes=3)]
    outcomes = backend(commands, tmp_path).submit(specs)
    assert outcomes[0].external_id == "100"
    assert all("SLURM became unreachable" in (o.error or "") for o in outcomes[1:])
    assert [o.transient for o in outcomes] == [False, True, True]  # dispatched again, not failed
    assert len(commands.named("sbatch")) == 2  # the third is not even tried


@pytest.mark.parametrize("accepted_before", [False, True])
def test_unreachable_while_a_refused_array_goes_one_by_one_keeps_those_queued(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path, accepted_before: bool
) -> None:
    # Queued jobs must keep their ids: left out, the next tick would submit them again (two runs,
    # one in nobody's sight, both writing in the job's folder).
    earlier = [make(tmp_path, 99, nodes=2)] if accepted_before else []
    commands.on("sbatch", *([sbatch] if earlier else []), fail(REFUSED), sbatch, sbatch, fail(UNREACHABLE))
    specs = [*earlier, *(make(tmp_path, n) for n in (1, 2, 3))]

    outcomes = backend(commands, tmp_path).submit(specs)

    queued = [(o.job_id, o.external_id) for o in outcomes if o.accepted]
    assert queued == ([(99, "100"), (1, "101"), (2, "102")] if earlier else [(1, "100"), (2, "101")])
    assert [(o.job_id, o.transient) for o in outcomes if not o.accepted] == [(3, True)]
    assert not list(specs[-1].files.submitit.iterdir())  # the one left out holds nothing yet


def test_scontrol_down_is_a_backend_error(commands: FakeCommands, tmp_path: Path) -> None:
    commands.on("scontrol", fail("slurm_load_ctl_conf error: Unable to contact slurm controller\n"))
    with pytest.raises(BackendError, match="scontrol show config failed"):
        backend(commands, tmp_path).submit([make(tmp_path, 1)])


def test_names_cannot_break_out_of_the_script(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    spec = make(tmp_path, 1).model_copy(update={"name": "x\nrm -rf / #"})
    backend(commands, tmp_path).submit([spec])
    (script,) = sbatch.scripts
    assert "#SBATCH --job-name=x_rm_-rf_" in script
    assert not [line for line in script.splitlines() if line.startswith("rm ")]


def test_a_folder_with_a_newline_is_refused_alone(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    bad = make(tmp_path, 1).model_copy(update={"folder": str(tmp_path / "a\nb")})
    outcomes = backend(commands, tmp_path).submit([bad, make(tmp_path, 2)])
    assert "control character" in (outcomes[0].error or "")
    assert outcomes[1].external_id == "100"


def test_allow_listed_options_reach_the_script(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    spec = make(
        tmp_path, 1, partition="debug", account="physics", qos="high", constraint="a100|h100", mem_gb=2
    )
    backend(commands, tmp_path).submit([spec])
    (script,) = sbatch.scripts
    for line in (
        "--partition=debug",
        "--account=physics",
        "--qos=high",
        "--constraint='a100|h100'",
        "--mem=2048M",
        "--time=5",
        "--job-name=job-1",
    ):
        assert f"#SBATCH {line}" in script


@pytest.mark.parametrize(
    "resources",
    [
        {"account": "a b"},
        {"qos": "x;y"},
        {"constraint": "a$(id)"},
        {"partition": "p\nq"},
        {"account": "x" * 129},
    ],
)
def test_free_form_values_are_refused_by_the_spec(tmp_path: Path, resources: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="resources"):
        make(tmp_path, 1, **resources)


def test_the_warning_signal_never_arrives_before_a_quarter_of_the_limit() -> None:
    from service.backends.slurm_request import warning_signal_delay_s

    assert warning_signal_delay_s(1) == 15
    assert warning_signal_delay_s(60) == 90
    assert warning_signal_delay_s(2) == 30


def test_each_account_s_jobs_go_out_in_an_sbatch_of_its_own_run_as_it(
    commands: FakeCommands, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", "postgresql://u:secret@db/x")  # the service's own
    scripts: list[tuple[list[str], str]] = []

    def sbatch_as(argv: Sequence[str]) -> CommandResult:
        scripts.append((list(argv[:-1]), Path(argv[-1]).read_text()))
        return ok(f"{100 + len(scripts)}\n")

    commands.on("scontrol", config())
    commands.on("sbatch", sbatch_as)
    commands.on("setpriv", sbatch_as)
    other = Account.named("nobody")
    specs = [make(tmp_path, 1), make(tmp_path, 2).model_copy(update={"run_as": "nobody"}), make(tmp_path, 3)]
    outcomes = backend(commands, tmp_path).submit(specs)

    assert [o.external_id for o in outcomes] == ["101_0", "102", "101_1"]  # same shape, two accounts
    (ours, array), (theirs, single) = scripts
    sbatch = ours[0]
    assert Path(sbatch).name == "sbatch" and ours[1:] == ["--parsable"]
    assert theirs == [*other.command_prefix(), sbatch, "--parsable"]  # queued as that account
    # sbatch's whole environment is the job's, which its default --export=ALL passes on: no list,
    # which would have slurmd load the account's login environment first.
    submitted = [env for argv, env in zip(commands.calls, commands.environments, strict=True)
                 if "--parsable" in argv]  # fmt: skip
    for env, account in zip(submitted, (Account.current(), other), strict=True):
        assert env is not None and env["HOME"] == account.home and env["USER"] == account.name
        assert env["PYTHONSAFEPATH"] == "1" and not any(key.startswith("TORCHYARD_") for key in env)
    for script in (array, single):
        assert "--export" not in script and "export PYTHONPATH" not in script
    (chdir,) = [line for line in single.splitlines() if line.startswith("#SBATCH --chdir=")]
    assert chdir.split("=", 1)[1] == str(specs[1].files.submitit)  # the job's own folder
    assert all(
        env is None
        for argv, env in zip(commands.calls, commands.environments, strict=True)
        if "--parsable" not in argv
    )  # other commands: the scheduler's minimal environment


def test_every_elements_link_stands_when_sbatch_runs(
    commands: FakeCommands, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The links are made on a helper thread while the pickles are written; sbatch waits for them,
    since an element may start as soon as sbatch answers. A slow link maker must not be overtaken."""
    real = slurm_submit.link_array_folders

    def slow_links(root: Path, folders: Sequence[Path]) -> None:
        time.sleep(0.3)
        real(root, folders)

    monkeypatch.setattr(slurm_submit, "link_array_folders", slow_links)
    specs = [make(tmp_path, n) for n in range(1, 6)]
    seen: list[Path] = []

    def sbatch(argv: Sequence[str]) -> CommandResult:
        script = Path(argv[2])
        for index, spec in enumerate(specs):
            link = script.parent / str(index)
            assert link.is_symlink() and link.resolve() == spec.files.submitit.resolve(), index
        seen.append(script)
        return ok("100;torchyard\n")

    commands.on("scontrol", config())
    commands.on("sbatch", sbatch)
    outcomes = backend(commands, tmp_path).submit(specs)
    assert [o.external_id for o in outcomes] == [f"100_{n}" for n in range(5)]
    assert len(seen) == 1


def test_a_link_that_cannot_be_made_fails_the_array_before_sbatch(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(root: Path, folders: Sequence[Path]) -> None:
        raise PermissionError(13, "Permission denied", str(root / "0"))

    monkeypatch.setattr(slurm_submit, "link_array_folders", no_links)
    specs = [make(tmp_path, n) for n in (1, 2)]
    outcomes = backend(commands, tmp_path).submit(specs)
    assert all(o.error is not None and "Permission denied" in o.error for o in outcomes), outcomes
    assert commands.named("sbatch") == []
    for spec in specs:  # no pickle left staged for a job that was never submitted
        assert list(spec.files.submitit.iterdir()) == []


@pytest.mark.parametrize("alone", [True, False])
def test_a_submitit_folder_the_job_swapped_for_a_link_gets_nothing_written_through_it(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path, alone: bool
) -> None:
    # The job folder is its account's: a job of the same account still running can put a link to a
    # folder of its choice where the dispatcher writes (as root) the pickle and the script.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    swapped = make(tmp_path, 1)
    Path(swapped.folder).mkdir(parents=True)
    swapped.files.submitit.symlink_to(elsewhere, target_is_directory=True)
    specs = [swapped] if alone else [swapped, make(tmp_path, 2)]

    outcomes = backend(commands, tmp_path).submit(specs)

    # The array it shares is its account's own: failing it together harms no one else.
    assert [outcome.accepted for outcome in outcomes] == [False] * len(specs)
    assert "Not a directory" in str(outcomes[0].error)
    assert list(elsewhere.iterdir()) == []
    assert sbatch.scripts == []


def test_a_folder_swapped_while_sbatch_runs_fails_that_element_alone_and_loses_no_id(
    commands: FakeCommands, sbatch: FakeSbatch, tmp_path: Path
) -> None:
    specs = [make(tmp_path, n) for n in (1, 2, 3)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def swap_then_accept(argv: Sequence[str]) -> CommandResult:
        moved = specs[1].files.submitit.rename(tmp_path / "moved")  # job 2's account, while SLURM answers
        specs[1].files.submitit.symlink_to(elsewhere, target_is_directory=True)
        assert list(moved.iterdir())  # its staged pickle went with the real folder
        return sbatch(argv)

    commands.on("sbatch", swap_then_accept)
    outcomes = backend(commands, tmp_path).submit(specs)

    assert [o.external_id for o in outcomes] == ["100_0", "100_1", "100_2"]  # all queued: none lost
    assert (specs[0].files.submitit / "100_0_submitted.pkl").exists()
    assert (specs[2].files.submitit / "100_2_submitted.pkl").exists()
    assert list(elsewhere.iterdir()) == []


def test_the_array_size_is_read_off_the_asking_thread(commands: FakeCommands, tmp_path: Path) -> None:
    """The dispatcher's claim asks with rows locked: it gets None at once while the size is unknown,
    and the one scontrol runs on a thread of its own."""
    commands.on("scontrol", config(max_array_size=7))
    slurm = backend(commands, tmp_path)
    assert slurm.scheduler_calls == 0  # building it asked nothing
    assert slurm.array_size() is None
    wait_for(lambda: slurm.array_size() == 7, 5, "MaxArraySize")
    assert len(commands.named("scontrol")) == 1
    slurm.submit([make(tmp_path, n) for n in range(2)])
    assert len(commands.named("scontrol")) == 1  # the submission reads the same size
