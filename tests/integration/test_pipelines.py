"""Pipelines end to end, real processes: a service process with the local and SLURM backends, the
`torchyard` command, and the jobs of examples/pipeline.yaml (prepare on this machine -> train on the 2
SLURM nodes -> evaluate the checkpoint train saved, read through ctx.upstream).

The hand-over between stages is timed. A stage's ranks end; the reconciler of its backend sees it at
its next poll (at most one interval of that backend later) and records the ending; the dispatch loop
then settles the stage after it (queued) and hands it to its backend in the same tick (at most one
dispatch interval later, sooner when the commit wakes it). So the gap from the moment a stage's rank 0
wrote its result (result.json's mtime, the real end) to the next stage's `submitted_at` is at most one
reconcile interval plus one dispatch interval, plus SLACK_S: the submission itself (one `sbatch` on
SLURM, a fork on the local backend) and the commits, each well under a second here. The gaps are
printed for the record (pytest -s).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cli_service import torchyard_command
from tests.integration.slurm.conftest import (
    Api,
    ServiceProcess,
    ledger_token,
    sacct_jobs,
    scancel,
    service_env,
    slurm_now,
)
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.slurm

PIPELINES = "/api/v1/pipelines"
EXAMPLE = ROOT / "examples" / "pipeline.yaml"
INTERVALS = {"slurm": 1.0, "local": 0.25}  # each backend's reconcile interval (settings below)
DISPATCH_S = 0.5
SLACK_S = 1.5  # one sbatch (or fork) and a few commits; see the module docstring


class Service:
    """A service process on this machine and the SLURM cluster, its ledger its own, with a token."""

    def __init__(self, tmp_path: Path) -> None:
        database = f"sqlite:///{tmp_path / 'ledger.db'}"
        self.data = tmp_path / "data"
        self.env = service_env(
            self.data,
            database,
            reconcile_interval_s=str(INTERVALS["slurm"]),
            local_reconcile_interval_s=str(INTERVALS["local"]),
            dispatch_interval_s=str(DISPATCH_S),
            rendezvous_timeout_s="60",
        )
        self.since = slurm_now()
        self.process = ServiceProcess(self.env, tmp_path / "service.log", cwd=tmp_path / "cwd")
        self.api = Api(self.process.url, ledger_token(database))
        self.cli_env = {**self.env, "TORCHYARD_URL": self.process.url, "TORCHYARD_TOKEN": self.api.token}

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*torchyard_command(), *args], cwd=ROOT, env=self.cli_env, capture_output=True,
                              text=True, timeout=timeout, check=False)  # fmt: skip

    def pipeline(self, pipeline_id: int) -> dict[str, Any]:
        found: dict[str, Any] = self.api.get(f"{PIPELINES}/{pipeline_id}").raise_for_status().json()
        return found

    def ended(self, pipeline_id: int, timeout: float = 240) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            pipeline = self.pipeline(pipeline_id)
            return pipeline if pipeline["state"] != "running" else None

        return wait_for(probe, timeout, f"pipeline {pipeline_id} to end")

    def cleanup(self) -> None:
        self.process.stop()
        rows = sacct_jobs(self.since, self.data)
        scancel(row["id"] for row in rows if row["state"] in ("PENDING", "RUNNING"))


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Service]:
    one = Service(tmp_path)
    yield one
    one.cleanup()


def submitted_id(done: subprocess.CompletedProcess[str]) -> int:
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("submitted pipeline "), done.stdout
    return int(first.split()[2])


def when(value: str) -> datetime:
    return datetime.fromisoformat(value).astimezone(timezone.utc)


def hand_overs(api: Api, pipeline: dict[str, Any]) -> list[tuple[str, float, float, float]]:
    """For each stage after the first: (stage, real end of the one before -> its submitted_at, that
    one's finished_at -> its submitted_at, -> its started_at), in seconds."""
    jobs = {stage["name"]: api.job(stage["job_id"]) for stage in pipeline["stages"]}
    gaps = []
    for stage in pipeline["stages"]:
        for before in stage["after"]:
            up, job = jobs[before], jobs[stage["name"]]
            real_end = datetime.fromtimestamp(
                (Path(up["folder"]) / "result.json").stat().st_mtime, timezone.utc
            )
            gaps.append((
                f"{before} ({up['backend']}) -> {stage['name']} ({job['backend']})",
                (when(job["submitted_at"]) - real_end).total_seconds(),
                (when(job["submitted_at"]) - when(up["finished_at"])).total_seconds(),
                (when(job["started_at"]) - when(up["finished_at"])).total_seconds(),
            ))  # fmt: skip
            assert gaps[-1][1] <= INTERVALS[up["backend"]] + DISPATCH_S + SLACK_S, gaps[-1]
    return gaps


def test_prepare_train_evaluate_succeeds_and_hands_over_within_an_interval(service: Service) -> None:
    done = service.cli("submit", str(EXAMPLE), "--wait", "--poll", "0.5")
    pipeline_id = submitted_id(done)
    assert done.returncode == 0, done.stdout + done.stderr
    pipeline = service.pipeline(pipeline_id)
    assert pipeline["state"] == "succeeded" and pipeline["finished_at"] is not None, pipeline
    ids = {stage["name"]: stage["job_id"] for stage in pipeline["stages"]}
    prepare, train, evaluate = (service.api.job(ids[name]) for name in ("prepare", "train", "evaluate"))
    assert (prepare["backend"], train["backend"], evaluate["backend"]) == ("local", "slurm", "local")
    assert train["nodes"] == "n[1-2]" and len(train["placement"]) == 2, train  # both nodes, a rank each
    assert train["result"]["dataset"] == prepare["result"]["path"] and train["result"]["world_size"] == 2
    assert evaluate["result"]["train_job"] == train["id"]
    assert evaluate["result"]["checkpoint"] == train["latest_checkpoint"]  # read through ctx.upstream
    assert evaluate["result"]["epoch"] == 1 and evaluate["result"]["loss"] > 0
    for name, gap_real, gap_ledger, to_start in hand_overs(service.api, pipeline):
        print(f"hand-over {name}: real end -> submitted {gap_real:.2f} s, finished_at -> submitted "
              f"{gap_ledger:.2f} s, finished_at -> started {to_start:.2f} s "
              f"(bound {INTERVALS['slurm'] if 'train (slurm) ->' in name else INTERVALS['local']} "
              f"+ {DISPATCH_S} + {SLACK_S} s)")  # fmt: skip
    shown = service.cli("pipeline", "show", str(pipeline_id))
    assert (
        shown.returncode == 0 and "prepare -> train" in shown.stdout and "train -> evaluate" in shown.stdout
    )


def test_a_failing_middle_stage_cancels_the_rest_and_retry_from_reruns_it(
    service: Service, tmp_path: Path
) -> None:
    switch = tmp_path / "train-breaks"  # while it is there, train fails (tmp: the nodes see it)
    switch.touch()
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["stages"][1]["job"]["kwargs"]["fail_while"] = str(switch)
    spec_file = tmp_path / "pipeline.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    pipeline_id = submitted_id(service.cli("submit", str(spec_file)))
    failed = service.ended(pipeline_id)
    assert failed["state"] == "failed", failed
    assert failed["reason"].startswith("stage 'train' failed: "), failed["reason"]
    first = {stage["name"]: stage for stage in failed["stages"]}
    assert [first[name]["state"] for name in ("prepare", "train", "evaluate")] == [
        "succeeded",
        "failed",
        "cancelled",
    ]
    assert first["evaluate"]["reason"].startswith(f"dependency job {first['train']['job_id']} (train) failed")

    switch.unlink()  # the fix
    retried = service.cli("pipeline", "retry", str(pipeline_id), "--from", "train")
    assert retried.returncode == 0, retried.stdout + retried.stderr
    final = service.ended(pipeline_id)
    assert final["state"] == "succeeded" and final["reason"] is None, final
    now = {stage["name"]: stage for stage in final["stages"]}
    assert now["prepare"]["job_id"] == first["prepare"]["job_id"] and now["prepare"]["runs"] == 1
    for name in ("train", "evaluate"):
        assert now[name]["job_id"] != first[name]["job_id"] and now[name]["runs"] == 2
        assert now[name]["state"] == "succeeded"
    evaluate = service.api.job(now["evaluate"]["job_id"])
    assert evaluate["result"]["train_job"] == now["train"]["job_id"]
    assert service.api.job(first["train"]["job_id"])["state"] == "failed"  # its first run, kept
