"""SlurmBackend.recover: a dispatcher killed while its sbatch ran leaves staged pickles and no
`<id>_submitted.pkl`; the job SLURM got anyway is found by its script's path (squeue's Command), and its
pickle gets the name submitit's runtime waits for. The squeue answers are recorded real output
(tests/data/slurm/squeue_submissions.txt) with this test's script paths and job ids put in."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from service.backends import slurm_parse as parse
from service.backends.slurm import SlurmBackend
from service.backends.slurm_commands import CommandResult
from service.backends.slurm_recovery import script_name, script_token, staged_pickles
from service.config import Settings
from service.errors import BackendError
from service.jobfs import submitted_external_id
from tests.support import wait_for
from tests.unit.backends.slurm_fakes import FakeCommands, fail, ok, recorded
from tests.unit.backends.test_slurm_submit import config, make
from worker.spec import JobFiles, RunSpec

RECORDED_DIR = "/tmp/tmp.zKG10gAQ35"
ARRAY_TOKEN = "0123456789abcdef0123456789abcdef"  # 39865_0..2, pending
SINGLE_TOKEN = "fedcba9876543210fedcba9876543210"  # 39866, pending
CANCELLED_TOKEN = "00000000000000000000000000000000"  # 39867, cancelled
UNREACHABLE = "squeue: error: Unable to contact slurm controller (connect failure)\n"


def test_recorded_rows_give_each_job_its_script_token() -> None:
    rows = parse.parse_submissions(recorded("squeue_submissions.txt"))

    assert [(row.job_id, row.state, row.array_index, script_token(row.command)) for row in rows] == [
        ("39867", "CANCELLED", 0, CANCELLED_TOKEN),
        ("39868", "PENDING", 0, None),  # --wrap: no script
        ("39866", "PENDING", 0, SINGLE_TOKEN),
        ("39865_0", "PENDING", 0, ARRAY_TOKEN),
        ("39865_1", "PENDING", 1, ARRAY_TOKEN),
        ("39865_2", "PENDING", 2, ARRAY_TOKEN),
    ]


class KilledDuringSbatch:
    """An sbatch that queues the job while its dispatcher is SIGKILLed: kill() puts every job folder back
    as it was while its own sbatch ran (its staged pickle, nothing renamed). Answers ids 100, 101, ..."""

    def __init__(self, jobs: Path) -> None:
        self.jobs = jobs
        self.scripts: list[str] = []
        self.staged: dict[Path, bytes] = {}

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        self.scripts.append(argv[2])
        for path in self.jobs.glob("*/submitit/.staged-*.pkl"):
            self.staged[path] = path.read_bytes()
        return ok(f"{99 + len(self.scripts)}\n")

    def kill(self) -> None:
        for path in self.jobs.glob("*/submitit/*_submitted.pkl"):
            path.unlink()
        for path, content in self.staged.items():
            path.write_bytes(content)
        for number, script in enumerate(self.scripts, start=100):
            Path(script).with_name(f"{number}_submission.sh").rename(script)

    def squeue(self, array_token: str | None = None, single_token: str | None = None) -> str:
        """The recorded squeue output, as if SLURM held these scripts, each where sbatch saw it: the
        array's as job 100 and the single job's as 101 (by default the first and second script)."""
        text = recorded("squeue_submissions.txt").replace("39865", "100").replace("39866", "101")
        for recorded_token, token, script in (
            (ARRAY_TOKEN, array_token, self.scripts[0]),
            (SINGLE_TOKEN, single_token, self.scripts[1]),
        ):
            place = Path(script).parent / script_name(token or script_token(script) or "")
            text = text.replace(f"{RECORDED_DIR}/{script_name(recorded_token)}", str(place))
        return text.replace(RECORDED_DIR, str(Path(self.scripts[0]).parent))


@pytest.fixture
def killed(commands: FakeCommands, tmp_path: Path) -> KilledDuringSbatch:
    fake = KilledDuringSbatch(tmp_path / "jobs")
    commands.on("scontrol", config())
    commands.on("sbatch", fake)
    return fake


def backend(commands: FakeCommands, tmp_path: Path) -> SlurmBackend:
    return SlurmBackend(
        Settings(data_dir=tmp_path / "data"), runner=commands, clock=commands.now, programs=commands.program
    )


def submit_and_kill(commands: FakeCommands, killed: KilledDuringSbatch, tmp_path: Path) -> list[RunSpec]:
    """An array of three and a single job, both queued by SLURM, neither seen by the dispatcher."""
    specs = [make(tmp_path, n) for n in (1, 2, 3)] + [make(tmp_path, 4, nodes=2)]
    outcomes = backend(commands, tmp_path).submit(specs)
    assert [o.external_id for o in outcomes] == ["100_0", "100_1", "100_2", "101"]
    killed.kill()
    for spec in specs:
        assert submitted_external_id(spec.files) is None  # what made the dispatcher submit it again
        assert [p.name.startswith(".staged-") for p in pickles(spec)] == [True]
    return specs


def pickles(spec: RunSpec) -> list[Path]:
    return list(spec.files.submitit.glob("*.pkl"))  # pathlib matches dot files too


def folders(specs: Sequence[RunSpec]) -> list[Path]:
    return [Path(spec.folder) for spec in specs]


def test_jobs_slurm_queued_are_found_by_their_script_and_can_run(
    commands: FakeCommands, killed: KilledDuringSbatch, tmp_path: Path
) -> None:
    specs = submit_and_kill(commands, killed, tmp_path)
    commands.on("squeue", ok(killed.squeue()))
    commands.calls.clear()

    answers = backend(commands, tmp_path).recover(folders(specs))

    assert answers == dict(zip(folders(specs), ["100_0", "100_1", "100_2", "101"], strict=True))
    assert [argv[:2] for argv in commands.calls] == [
        ["/opt/slurm/bin/squeue", "-h"]
    ]  # one query, for every account
    for spec, external_id in zip(specs, ["100_0", "100_1", "100_2", "101"], strict=True):
        assert submitted_external_id(spec.files) == external_id  # the name submitit's runtime waits for
        assert [p.name for p in pickles(spec)] == [f"{external_id}_submitted.pkl"]


def test_a_staged_pickle_named_after_another_job_s_script_adopts_nothing(
    commands: FakeCommands, killed: KilledDuringSbatch, tmp_path: Path
) -> None:
    # Job 5's account renames a file of its folder after the array's token (squeue shows everyone's
    # scripts): adopted, job 5 would be polled and cancelled as another job, perhaps another user's.
    specs = submit_and_kill(commands, killed, tmp_path)
    planter = make(tmp_path, 5)
    planter.files.submitit.mkdir(parents=True)
    token = script_token(killed.scripts[0])
    (planter.files.submitit / f".staged-{token}-1.pkl").write_bytes(b"")
    commands.on("squeue", ok(killed.squeue()))

    answers = backend(commands, tmp_path).recover([*folders(specs), Path(planter.folder)])

    assert answers[Path(planter.folder)] is None
    assert answers[Path(specs[1].folder)] == "100_1"  # the element's own folder still finds it
    assert not list(planter.files.submitit.glob("*_submitted.pkl"))


@pytest.mark.parametrize("index", ["\u00b2", "9" * 200, "", "1x"])
def test_a_staged_pickle_with_no_usable_index_is_no_staged_pickle(
    commands: FakeCommands, tmp_path: Path, index: str
) -> None:
    """Issue 35, finding 4: `.staged-x-\u00b2.pkl` passed str.isdigit(), int() raised, and recovery
    stopped dispatch for everyone."""
    spec = make(tmp_path, 5)
    spec.files.submitit.mkdir(parents=True)
    (spec.files.submitit / f".staged-{'a' * 32}-{index}.pkl").write_bytes(b"")
    assert staged_pickles(spec.files.submitit) == []
    assert backend(commands, tmp_path).recover([Path(spec.folder)]) == {Path(spec.folder): None}


def test_a_submission_slurm_does_not_hold_or_already_ended_is_safe_to_send_again(
    commands: FakeCommands, killed: KilledDuringSbatch, tmp_path: Path
) -> None:
    specs = submit_and_kill(commands, killed, tmp_path)
    # The array's script is unknown to SLURM; the single job's is the one that was cancelled.
    single = script_token(killed.scripts[1])
    assert single is not None
    text = killed.squeue(array_token="f" * 32, single_token="e" * 32).replace(CANCELLED_TOKEN, single)
    commands.on("squeue", ok(text))

    answers = backend(commands, tmp_path).recover(folders(specs))

    assert answers == {folder: None for folder in folders(specs)}
    for spec in specs:  # those pickles will never be read: nothing is left behind
        assert pickles(spec) == []


@pytest.fixture
def sbatch_still_running(killed: KilledDuringSbatch) -> Iterator[None]:
    """A process on this host with the array's script on its command line, as a dead dispatcher's sbatch."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", killed.scripts[0]])
    # Until the child has exec'd, /proc shows the parent's command line: wait for the script on it.
    cmdline = Path(f"/proc/{process.pid}/cmdline")
    wait_for(lambda: str(killed.scripts[0]).encode() in cmdline.read_bytes(), 10, "the fake sbatch to start")
    yield
    process.kill()
    process.wait()


def test_a_submission_whose_sbatch_still_runs_cannot_be_told_yet(
    commands: FakeCommands, killed: KilledDuringSbatch, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    specs = submit_and_kill(commands, killed, tmp_path)
    commands.on("squeue", ok(killed.squeue(array_token="f" * 32)))  # the array is not queued (yet)
    request.getfixturevalue("sbatch_still_running")

    answers = backend(commands, tmp_path).recover(folders(specs))

    assert answers == {Path(specs[3].folder): "101"}  # the array's three are left out: keep their claims
    for spec in specs[:3]:
        assert [p.name.startswith(".staged-") for p in pickles(spec)] == [True]


def test_no_staged_pickle_costs_no_call_and_an_unreachable_controller_is_an_error(
    commands: FakeCommands, killed: KilledDuringSbatch, tmp_path: Path
) -> None:
    empty = tmp_path / "jobs" / "9"
    JobFiles(empty).submitit.mkdir(parents=True)
    slurm = backend(commands, tmp_path)

    assert slurm.recover([empty]) == {empty: None}
    assert commands.calls == []

    specs = submit_and_kill(commands, killed, tmp_path)
    commands.on("squeue", fail(UNREACHABLE))
    with pytest.raises(BackendError, match="Unable to contact slurm controller"):
        slurm.recover(folders(specs))
    for spec in specs:  # kept for the next try
        assert [p.name.startswith(".staged-") for p in pickles(spec)] == [True]


def test_an_adopted_id_whose_script_is_another_folder_s_is_disowned(
    commands: FakeCommands, killed: KilledDuringSbatch, tmp_path: Path
) -> None:
    specs = [make(tmp_path, n) for n in (1, 2, 3)] + [make(tmp_path, 4, nodes=2)]
    backend(commands, tmp_path).submit(specs)
    planter = make(tmp_path, 5)
    planter.files.submitit.mkdir(parents=True)
    commands.on("squeue", ok(killed.squeue()))
    named = {
        Path(specs[1].folder): "100_1",  # its own element
        Path(specs[3].folder): "101",  # its own single job
        Path(planter.folder): "100_1",  # a name its account made: another folder's element
        Path(specs[0].folder): "99999",  # SLURM shows it no more: nothing to tell, nothing to harm
    }

    assert backend(commands, tmp_path).disowned(named) == {Path(planter.folder)}
    assert [argv[:2] for argv in commands.named("squeue")] == [
        ["/opt/slurm/bin/squeue", "-h"]
    ]  # one query for all
