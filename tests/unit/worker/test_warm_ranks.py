"""A rank forked from the job's warm parent (worker.warm_ranks) is what a cold one would be: the same
variables, folder, sys.argv and sys.path, nothing on stdin, its own logs; and its end is told as a
cold one's is, a signal's included. Real processes: the parent imports torch, the ranks run a script."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from worker.run_local import LocalRuns, ProcessRun
from worker.spec import RunSpec
from worker.supervisor import RunEnd

pytestmark = pytest.mark.timeout(120)

FACTS = """
import json, os, sys, time
names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "TORCHYARD_RUN", "OMP_NUM_THREADS", "TMPDIR",
         "FROM_SPEC", "TORCHYARD_JOB_DIR", "SUBMITIT_LOCAL_NTASKS")
print("FACTS " + json.dumps({"env": {name: os.environ.get(name) for name in names}, "cwd": os.getcwd(),
      "argv": sys.argv, "path": sys.path, "stdin": sys.stdin.read(), "torch": "torch" in sys.modules}))
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
"""


def make_spec(tmp_path: Path, name: str, **env: str) -> RunSpec:
    folder = tmp_path / name
    folder.mkdir()
    script = folder / "facts.py"
    script.write_text(FACTS)
    spec = RunSpec.model_validate({
        "job_id": 7, "name": name, "script": str(script), "folder": str(folder),
        "env": {"FROM_SPEC": "yes", **env},
        "resources": {"nodes": 1, "tasks_per_node": 2, "cpus_per_task": 1},
    })
    spec.files.spec.write_text(spec.model_dump_json())
    spec.files.rank_log("42", 0, "out").parent.mkdir()  # submitit's folder: its controller makes it
    return spec


def run_to_end(run: ProcessRun, timeout: float = 90) -> RunEnd:
    deadline = time.monotonic() + timeout
    while (end := run.ended()) is None:
        assert time.monotonic() < deadline, "the run did not end"
        time.sleep(0.05)
    return end


def facts(spec: RunSpec, rank: int) -> dict[str, object]:
    text = spec.files.rank_log("42", rank, "out").read_text()
    line = next(line for line in text.splitlines() if line.startswith("FACTS "))
    found: dict[str, object] = json.loads(line.removeprefix("FACTS "))
    return found


def start(spec: RunSpec, *, warm: bool, run: int = 0) -> tuple[LocalRuns, ProcessRun]:
    runs = LocalRuns(spec, requeues=0, external_id="42")
    runs.warm_failed = not warm
    return runs, runs.start(spec.files.spec, run, runs.hosts())


def test_a_forked_rank_is_what_a_cold_one_is(tmp_path: Path) -> None:
    cold_spec, warm_spec = make_spec(tmp_path, "cold"), make_spec(tmp_path, "warm")
    _, cold = start(cold_spec, warm=False, run=1)
    warm_runs, warm = start(warm_spec, warm=True, run=1)

    assert run_to_end(cold) == RunEnd(ok=True)
    assert run_to_end(warm) == RunEnd(ok=True)
    assert warm_runs.warm is not None, "the warm parent did not start"
    for rank in (0, 1):
        seen_cold, seen_warm = facts(cold_spec, rank), facts(warm_spec, rank)
        assert seen_warm == json.loads(json.dumps(seen_cold).replace("/cold", "/warm")), rank
        assert seen_warm["stdin"] == "" and seen_warm["torch"] is True
        env = seen_warm["env"]
        assert isinstance(env, dict)
        assert (env["RANK"], env["TORCHYARD_RUN"], env["FROM_SPEC"]) == (str(rank), "1", "yes")
        log = warm_spec.files.rank_log("42", rank, "out").read_text()
        assert log.startswith(f"torchyard: job 7 attempt 1 run 1: global_rank={rank} "), log


def test_forked_ranks_come_from_one_parent_and_restarts_fork_again(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "again")
    runs, first = start(spec, warm=True)
    assert run_to_end(first) == RunEnd(ok=True)
    parent = runs.warm
    second = runs.start(spec.files.spec, 1, runs.hosts())
    assert run_to_end(second) == RunEnd(ok=True)
    assert runs.warm is parent and parent is not None and parent.usable([None])
    assert {process.pid for process in second.processes.values()}.isdisjoint(
        process.pid for process in first.processes.values())


def test_a_forked_rank_killed_by_a_signal_is_told_as_a_cold_one(tmp_path: Path) -> None:
    spec = make_spec(tmp_path, "killed", SLEEP="60")
    _, run = start(spec, warm=True)
    deadline = time.monotonic() + 60
    while not all(spec.files.rank_log("42", rank, "out").exists() and "FACTS" in
                  spec.files.rank_log("42", rank, "out").read_text() for rank in (0, 1)):
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.05)
    run.processes[1].send_signal(signal.SIGKILL)

    end = run_to_end(run)
    run.stop()

    assert (end.cause, end.rank, end.detail) == ("node_failure", 1, "killed by SIGKILL")
    assert all(process.poll() is not None for process in run.processes.values())


def test_without_torch_the_ranks_start_cold_and_say_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = make_spec(tmp_path, "no-torch")
    shadow = tmp_path / "shadow" / "torch"  # an interpreter whose torch cannot be imported
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no torch here')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    runs, run = start(spec, warm=True)

    end = run_to_end(run)

    assert runs.warm is None and runs.warm_failed
    assert end.cause == "failure" and end.rank == 0, end
    error = spec.files.error(0).read_text()
    assert "cannot run ranks: no torch here" in error, error


class RecordingParents:
    """Stands in for the warm parents of an srun step: records each fork it is asked for."""

    def __init__(self) -> None:
        self.forks: list[tuple[int, dict[str, str], Path, Path, str | None]] = []

    def fork(self, rank: int, env: dict[str, str], out: Path, err: Path, spec_path: Path,
             host: str | None = None) -> object:
        self.forks.append((rank, env, out, err, host))
        return object()


def test_a_rank_forked_on_a_slurm_node_has_the_variables_and_logs_an_srun_step_gives(tmp_path: Path) -> None:
    from worker.distributed import derive_rank_env
    from worker.run_slurm import SlurmRuns

    spec = make_spec(tmp_path, "slurm").model_copy(update={"resources": {"nodes": 2, "tasks_per_node": 2}})
    spec = RunSpec.model_validate(spec.model_dump())
    # The array element 3 of array 40 (job 43), on an allocation of n1..n3 whose n2 was lost.
    batch = {"SLURM_JOB_ID": "43", "SLURM_ARRAY_JOB_ID": "40", "SLURM_ARRAY_TASK_ID": "3",
             "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_PROCID": "0", "SLURM_NTASKS": "3",
             "SLURM_STEP_NODELIST": "n[1-3]", "TORCHYARD_SRUN": "/usr/bin/srun",
             "TORCHYARD_RANK_OUTPUT": "/f/%a/%A_%a_%t_log.out", "TORCHYARD_RANK_ERROR": "/f/%j_%t_log.err"}
    runs = SlurmRuns(spec, batch, requeues=1)
    parents = RecordingParents()

    run = runs.fork(parents, spec.files.spec, 2, ["n1", "n3"])  # type: ignore[arg-type]

    assert run is not None
    placed = [(rank, host) for rank, _, _, _, host in parents.forks]
    assert placed == [(0, "n1"), (1, "n1"), (2, "n3"), (3, "n3")]
    _, env, out, err, _ = parents.forks[3]
    assert (out, err) == (Path("/f/3/40_3_3_log.out"), Path("/f/43_3_log.err"))
    seen = derive_rank_env({**batch, **env}, job_id="43", gpus_per_node=0)
    assert (seen.rank, seen.world_size, seen.local_rank, seen.local_world_size) == (3, 4, 1, 2)
    assert (seen.node_rank, seen.master_addr, seen.run) == (1, "n1", 2)  # rank 0's node, not the lost n2
