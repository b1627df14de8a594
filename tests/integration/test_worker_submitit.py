"""The job's supervisor through submitit's REAL local executor: real processes, real gloo, real signals.

Each job is submitted as the service's local backend submits it: one task, worker.launch.Supervisor,
which starts the ranks itself (forked from the job's warm parent), watches them and ends or restarts
the run. Each job pays for torch's import once (a few seconds on 2 cores), so the file runs few, small
jobs and shares the uninterrupted training run between the tests that compare against it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import submitit
from submitit.core.utils import FailedJobError

from worker.launch import Supervisor
from worker.spec import CheckpointRecord, ProgressRecord, RunSpec, parse_activity, parse_progress_line

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TRAIN = "worker.tasks.train:train"
TRAIN_KWARGS: dict[str, Any] = {"epochs": 4, "samples": 256, "batch_size": 32, "seed": 3}


def make_spec(folder: Path, *, tasks: int, entrypoint: str | None = None, **fields: Any) -> RunSpec:
    return RunSpec.model_validate({
        "job_id": 1, "name": folder.name, "entrypoint": entrypoint, "folder": str(folder),
        "resources": {"tasks_per_node": tasks, "timeout_min": 3}, "rendezvous_timeout_s": 120, **fields,
    })


ENDS = {"restarts": {"max": 0}}  # the tests of an attempt that ends: no restart in place


def submit(spec: RunSpec) -> submitit.Job[Any]:
    """Submit as the service's local backend does (service.backends.local): submitit's local controller
    on JobFiles.submitit, one task, the job's supervisor, which starts the ranks."""
    executor = submitit.AutoExecutor(folder=spec.files.submitit, cluster="local")
    executor.update_parameters(timeout_min=int(spec.resources.timeout_min),  # submitit refuses floats
                               tasks_per_node=1, gpus_per_node=spec.resources.gpus_per_node)
    return executor.submit(Supervisor(spec.model_dump_json()))


def rank_log(spec: RunSpec, job: submitit.Job[Any], rank: int) -> str:
    """Rank `rank`'s stderr (rank 0's holds the supervisor's lines too)."""
    return spec.files.rank_log(job.job_id, rank, "err").read_text()


def wait(job: submitit.Job[Any], limit_s: float) -> float:
    """Seconds until the job (its supervisor, and with it every rank) has ended; fails past `limit_s`."""
    started = time.monotonic()
    while not job.done():
        assert time.monotonic() - started < limit_s, f"job {job.job_id} still running after {limit_s}s"
        time.sleep(0.2)
    return time.monotonic() - started


def result_of(spec: RunSpec) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(spec.files.result.read_text())
    assert data["attempt"] == spec.attempt
    return data["value"]  # type: ignore[no-any-return]


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line contains `text` (the submitit folder names a job's processes)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry.name))
    return kids


@pytest.fixture(scope="module")
def uninterrupted_train(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference: one uninterrupted 2-rank training run of TRAIN_KWARGS."""
    spec = make_spec(tmp_path_factory.mktemp("train-ref"), tasks=2, entrypoint=TRAIN, kwargs=TRAIN_KWARGS)
    job = submit(spec)
    wait(job, 90)
    return result_of(spec)


@pytest.fixture(autouse=True)
def _no_leftover_processes(tmp_path: Path) -> Iterator[None]:
    yield
    deadline = time.monotonic() + 10
    while (left := processes_mentioning(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}"


def test_ddp_parameters_on_three_ranks(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, tasks=3, entrypoint="worker.tasks.seed:ddp_parameters", kwargs={"seed": 1})
    job = submit(spec)
    assert job.results() == [None]  # the supervisor's return; the verdict is rank 0's result.json
    value = result_of(spec)
    assert value["ok"], value
    assert value["world_size"] == 3
    assert value["initial_params_differed_before_ddp"] and value["initial_params_match_rank0"]
    assert value["params_identical_after_step"] and value["matches_averaged_gradient_step"]
    assert value["max_abs_diff"] < 1e-5


def test_sampler_shards_on_four_ranks(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, tasks=4, entrypoint="worker.tasks.seed:sampler_shards")
    submit(spec).results()
    value = result_of(spec)
    assert value["ok"], value
    assert value["shards"] == {"0": [0, 4], "1": [1, 5], "2": [2, 6], "3": [3, 7]}
    assert value["dataset_identical_on_all_ranks"]
    assert value["shards_disjoint"] and value["shards_cover_dataset"]


def test_train_loss_falls_and_a_second_launch_resumes(tmp_path: Path,
                                                      uninterrupted_train: dict[str, Any]) -> None:
    assert uninterrupted_train["ok"] and uninterrupted_train["final_loss"] < uninterrupted_train["first_loss"]
    assert uninterrupted_train["epochs_run"] == 4 and uninterrupted_train["resumed_from_epoch"] is None

    first = make_spec(tmp_path, tasks=2, entrypoint=TRAIN, kwargs={**TRAIN_KWARGS, "epochs": 2})
    submit(first).results()
    records = [parse_progress_line(line) for line in first.files.progress.read_text().splitlines()]
    checkpoints = [record.checkpoint for record in records if isinstance(record, CheckpointRecord)]
    assert len(checkpoints) == 2 and all(Path(path).is_file() for path in checkpoints)
    progress = [record for record in records if isinstance(record, ProgressRecord)]
    assert progress and all(record.total == 8 and "loss" in record.metrics for record in progress)

    # A new attempt in the same folder (as the service would send after a failure) picks up the newest.
    second = first.model_copy(update={"attempt": 2, "kwargs": TRAIN_KWARGS})
    submit(second).results()
    value = result_of(second)
    assert value["resumed_from_epoch"] == 1 and value["epochs_run"] == 2
    # Where the epochs' time went (bench.train's numbers): this attempt's steps only.
    timing, whole = value["timing"], uninterrupted_train["timing"]
    assert timing["steps"] == whole["steps"] // 2 == value["steps"] - 8
    assert timing["samples"] == timing["steps"] * TRAIN_KWARGS["batch_size"] * 2
    assert 0 < timing["report_s"] + timing["checkpoint_s"] < timing["epochs_s"]
    assert value["first_loss"] == uninterrupted_train["first_loss"]
    assert value["param_checksum"] == uninterrupted_train["param_checksum"]


def test_preempted_train_requeues_and_matches_uninterrupted_bit_for_bit(
        tmp_path: Path, uninterrupted_train: dict[str, Any]) -> None:
    spec = make_spec(tmp_path, tasks=2, entrypoint=TRAIN, kwargs={**TRAIN_KWARGS, "sleep_per_step": 0.25})
    job = submit(spec)
    deadline = time.monotonic() + 60
    while not (spec.files.progress.exists() and '"checkpoint"' in spec.files.progress.read_text()):
        assert time.monotonic() < deadline and not job.done(), "no checkpoint before the deadline"
        time.sleep(0.1)
    (supervisor,) = children_of(int(job.job_id))  # the controller's one task
    # The checkpoint signal goes to the supervisor alone, as submitit's controller sends it before the
    # time limit and SLURM to the batch step (--signal=B:USR2); submitit's handler there requeues, and
    # the supervisor stops its ranks on the way out.
    os.kill(supervisor, signal.SIGUSR2)
    wait(job, 90)

    value = result_of(spec)
    resumed = value["resumed_from_epoch"]
    assert resumed is not None and resumed < TRAIN_KWARGS["epochs"] - 1, "it must have stopped mid-run"
    assert value["param_checksum"] == uninterrupted_train["param_checksum"]
    assert not list(spec.files.folder.glob("error-rank*.txt")), "a preemption is not an error"
    assert "Requeued job" in (job.stdout() or "")
    assert not (spec.files.folder / "restarts.jsonl").exists(), "a requeue is not a restart in place"
    # The requeued run (same controller, same job id) rendezvoused under a new name, not the old port's.
    names = sorted(path.name for path in (spec.files.folder / "rendezvous").iterdir())
    assert names == [f"{job.job_id}-a1-r0.json", f"{job.job_id}-a1-r1.json"]


def test_script_mode_runs_an_unmodified_torchrun_script(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, tasks=2, script=str(REPO / "examples/scripts/torchrun_style.py"),
                     args=["--out", "sum.json", "--value", "2"])
    submit(spec).results()
    report = json.loads((spec.files.folder / "sum.json").read_text())
    assert report["world_size"] == 2 and report["sum"] == report["expected"] == 6.0
    (published,) = published_ports(spec)  # rank 0 picked a free port and told the other rank
    assert report["master"] == f"127.0.0.1:{published}"
    assert result_of(spec) is None
    for rank in (0, 1):  # a script is watched as a function is: stacks on SIGURG, an activity file
        activity = parse_activity(spec.files.activity(rank).read_text())
        assert spec.files.stacks(rank).is_file() and activity is not None and activity.rank == rank


def published_ports(spec: RunSpec) -> list[int]:
    """The ports rank 0 published in the job folder, one per run of the ranks."""
    folder = spec.files.folder / "rendezvous"
    return [json.loads(path.read_text())["port"] for path in sorted(folder.glob("*.json"))]


def test_two_jobs_at_once_get_different_ports_even_where_the_old_ones_collide(tmp_path: Path) -> None:
    specs = [make_spec(tmp_path / name, tasks=2, entrypoint="worker.tasks.faults:sleep",
                       kwargs={"seconds": 3}) for name in ("a", "b")]
    jobs = [submit(spec) for spec in specs]
    # The old scheme's port (20000 + controller PID mod 10000), held by someone else, as a congruent
    # job's rank 0 would have held it. The warm parents are still importing torch: no rank binds yet.
    squatters = []
    for job in jobs:
        squatter = socket.socket()
        try:
            squatter.bind(("", 20000 + int(job.job_id) % 10000))
            squatter.listen()
            squatters.append(squatter)
        except OSError:
            squatter.close()  # taken already by something else: the point stands all the more
    assert squatters, "could hold neither job's old port"
    try:
        for job in jobs:
            wait(job, 120)
    finally:
        for squatter in squatters:
            squatter.close()
    for job, spec in zip(jobs, specs, strict=True):
        assert result_of(spec)["ok"], job.stderr()
    ports = [published_ports(spec) for spec in specs]
    assert len(ports[0]) == len(ports[1]) == 1 and ports[0] != ports[1]
    for spec, job, (port,) in zip(specs, jobs, ports, strict=True):
        for rank in (0, 1):  # every rank joined the group on its own job's port
            assert f"master=127.0.0.1:{port} " in rank_log(spec, job, rank)
    # ... and the two jobs ran at the same time: rank 0's progress lines overlap in time.
    spans = []
    for spec in specs:
        times = [record.time for line in spec.files.progress.read_text().splitlines()
                 if (record := parse_progress_line(line)) is not None]
        stamped = [when for when in times if when is not None]
        assert stamped and len(stamped) == len(times)  # rank 0 stamps every line it writes
        spans.append((min(stamped), max(stamped)))
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], spans


def test_a_raising_rank_fails_the_job_promptly_with_its_traceback(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, tasks=2, entrypoint="worker.tasks.faults:raise_on_rank",
                     kwargs={"rank": 1, "message": "boom on purpose"}, rendezvous_timeout_s=300, **ENDS)
    job = submit(spec)
    elapsed = wait(job, 60)  # far less than the 300 s group timeout: rank 0 did not wait it out
    assert elapsed < 60
    error = spec.files.error(1).read_text()
    assert "Traceback" in error and "RuntimeError: boom on purpose (rank 1)" in error
    assert "by peer" in spec.files.error(0).read_text()  # gloo: "closed by peer" or "reset by peer"
    assert not spec.files.result.exists()
    with pytest.raises(FailedJobError, match=r"AttemptEnded: rank 1 on \S+ raised \(RuntimeError: boom"):
        job.results()


def test_a_crashing_rank_ends_the_job_promptly_too(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, tasks=2, entrypoint="worker.tasks.faults:exit_on_rank",
                     kwargs={"rank": 1, "code": 3}, rendezvous_timeout_s=300, **ENDS)
    job = submit(spec)
    assert wait(job, 60) < 60
    assert not spec.files.error(1).exists(), "os._exit leaves no traceback to write"
    assert "by peer" in spec.files.error(0).read_text()  # gloo: "closed by peer" or "reset by peer"
    assert not spec.files.result.exists()
    with pytest.raises(FailedJobError, match=r"rank 1 on \S+ raised \(exit code 3 without"):
        job.results()


def test_a_rank_stuck_before_the_rendezvous_is_ended_with_the_job(tmp_path: Path) -> None:
    """No service watches here: the supervisor alone must end a job whose rank 0 never publishes its port.

    Rank 1 gives up on the rendezvous and fails; its failure ends the run (restarts in place do not
    take `failure`, and are off here), and the supervisor stops rank 0, stuck in its stall, once it has
    had SETTLE_S to fail by itself. submitit's local controller waits for its task, so without that the
    stuck rank would keep the job alive for the whole stall (600 s), long after rank 1 gave up.
    """
    spec = make_spec(tmp_path, tasks=2, entrypoint="worker.tasks.faults:sleep", kwargs={"seconds": 1},
                     rendezvous_timeout_s=10, env={"STALL_BEFORE_RENDEZVOUS": "0:600"}, **ENDS)
    job = submit(spec)
    elapsed = wait(job, 90)  # torch's import + the 10 s timeout + SETTLE_S + STOP_GRACE_S, with room
    assert elapsed >= 10
    error = spec.files.error(1).read_text()
    assert "RendezvousError: rank 0 did not publish its rendezvous port" in error and "within 10s" in error
    assert not spec.files.error(0).exists(), "the stuck rank was stopped by the supervisor, not failed"
    log = rank_log(spec, job, 0)  # rank 0's stderr, and the supervisor's
    assert "stalling 600 s before the rendezvous on purpose" in log
    ended = r"\[supervisor\] .* run 0 of attempt 1 ended: rank 1 on \S+ raised \(\S*RendezvousError"
    assert re.search(ended, log), log
    assert not spec.files.result.exists()
    with pytest.raises(FailedJobError, match="restarts in place are off"):
        job.results()
