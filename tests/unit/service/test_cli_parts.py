"""The CLI's parts without a service: spec loading, examples, rendering, progress, log following,
the demo's own checks, and the commands against an httpx.MockTransport."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
import yaml
from rich.console import Console
from typer.testing import CliRunner

import service.cli.context as cli_context
from service.cli.context import EXIT_JOB_FAILED, EXIT_REQUEST
from service.cli.demo import DDP_SPEC, SAMPLER_SPEC
from service.cli.demo_checks import check_ddp, check_sampler
from service.cli.jobs import outcome
from service.cli.logs import LogFollower, new_part
from service.cli.main import app
from service.cli.progress import bar_position, carry_progress, watch_jobs
from service.cli.render import goodput_text, job_details, jobs_table, progress_text
from service.cli.specs import load_spec
from service.client import TorchyardClient
from service.ledger.models.jobs import JobCreate
from service.ledger.models.pipelines import PipelineCreate
from service.ledger.models.sweeps import SweepCreate
from service.states import TERMINAL_STATE_NAMES
from tests.support import ROOT

EXAMPLES = ROOT / "examples"

DDP_RESULT: dict[str, Any] = {
    "ok": True,
    "world_size": 3,
    "initial_params_differed_before_ddp": True,
    "initial_params_match_rank0": True,
    "params_identical_after_step": True,
    "matches_averaged_gradient_step": True,
    "max_abs_diff": 7.45e-09,
    "loss_per_rank": [0.90, 1.07, 1.70],
    "backend": "gloo",
}
SAMPLER_RESULT: dict[str, Any] = {
    "ok": True,
    "world_size": 4,
    "num_samples": 8,
    "shards": {"0": [0, 4], "1": [1, 5], "2": [2, 6], "3": [3, 7]},
    "dataset_identical_on_all_ranks": True,
    "dataset_checksum": "46e82db66fbd8858a214e26cf7f8be3ab5639ef7cedd23f405c7c149f05b1539",
    "samples_match_dataset_rows": True,
}


def job(job_id: int = 1, state: str = "running", **extra: Any) -> dict[str, Any]:
    return {
        "id": job_id,
        "name": f"job-{job_id}",
        "state": state,
        "backend": "local",
        "spec": {"entrypoint": "m:f", "resources": {"nodes": 1, "tasks_per_node": 2}},
        "created_at": "2026-01-01T00:00:00Z",
        **extra,
    }


# ---------------------------------------------------------------- specs and examples


def test_load_spec_reads_yaml_and_json_and_resolves_a_relative_script(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: a\nscript: scripts/x.py\nargs: ['--n', '1']\n")
    (tmp_path / "b.json").write_text(json.dumps({"name": "b", "script": "/abs/y.py"}))
    assert load_spec(tmp_path / "a.yaml")["script"] == str(tmp_path / "scripts" / "x.py")
    assert load_spec(tmp_path / "b.json")["script"] == "/abs/y.py"


@pytest.mark.parametrize("text", ["- just\n- a list\n", "name: [unclosed\n"])
def test_load_spec_refuses_what_is_not_one_mapping(tmp_path: Path, text: str) -> None:
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(typer.Exit) as caught:
        load_spec(tmp_path / "bad.yaml")
    assert caught.value.exit_code == EXIT_REQUEST


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_is_a_valid_job_sweep_or_pipeline_spec(path: Path) -> None:
    loaded = load_spec(path)
    if "stages" in loaded:  # a pipeline: each stage's job (or sweep's job) a valid spec
        stages = PipelineCreate.model_validate(loaded).stages
        specs = [JobCreate.model_validate({"name": stage.name, **(stage.job or {})}) if stage.job is not None
                 else SweepCreate.model_validate({"name": stage.name, **(stage.sweep or {})}).job
                 for stage in stages]  # fmt: skip
    else:
        one = SweepCreate.model_validate(loaded).job if "grid" in loaded else JobCreate.model_validate(loaded)
        specs = [one]
    for spec in specs:
        if spec.script is not None:
            assert Path(spec.script).is_file(), spec.script


def test_the_demo_submits_exactly_the_example_specs() -> None:
    assert yaml.safe_load((EXAMPLES / "ddp_parameters.yaml").read_text()) == DDP_SPEC
    assert yaml.safe_load((EXAMPLES / "sampler_shards.yaml").read_text()) == SAMPLER_SPEC


# ---------------------------------------------------------------- rendering and progress


def test_progress_text_puts_loss_first_and_bar_position_fills_on_success() -> None:
    running = job(progress={"step": 8, "total": 40, "metrics": {"epoch": 1.0, "loss": 0.123456}})
    assert progress_text(running) == "step 8/40 loss 0.1235 epoch 1"
    assert bar_position(running) == (8.0, 40.0)
    assert bar_position(job(state="succeeded")) == (1.0, 1.0)
    assert bar_position(job(progress=None)) == (0.0, None)  # no total yet: a pulsing bar


def test_carry_progress_keeps_total_and_metrics_across_a_bare_line() -> None:
    before = job(progress={"step": 8, "total": 40, "metrics": {"loss": 0.5}})
    checkpoint_line = job(progress={"step": 16, "total": None, "metrics": None})
    assert carry_progress(before, checkpoint_line)["progress"] == {
        "step": 16,
        "total": 40,
        "metrics": {"loss": 0.5},
    }
    assert carry_progress(None, checkpoint_line) == checkpoint_line


def test_table_and_details_show_what_a_person_asks_for() -> None:
    failed = job(
        2,
        "failed",
        reason="rank 1 raised:\nTraceback ...\nRuntimeError: boom",
        exit_code=1,
        started_at="2026-01-01T00:00:01Z",
        finished_at="2026-01-01T00:00:09Z",
    )
    console = Console(file=io.StringIO(), width=200)
    console.print(jobs_table([failed, job(1, "succeeded", reason="completed")], width=200))
    table = console.file.getvalue()  # type: ignore[attr-defined]
    assert "RuntimeError: boom" in table and "completed" not in table and "8.0s" in table
    console = Console(file=io.StringIO(), width=200)
    console.print(job_details(failed, [{"time": "t", "from_state": "running", "to_state": "failed"}]))
    details = console.file.getvalue()  # type: ignore[attr-defined]
    assert "Traceback" in details and "exit code" in details and "history" in details


def test_details_of_a_retried_job_show_its_attempts_and_where_its_ranks_ran() -> None:
    placement = [
        {"rank": rank, "host": host, "local_rank": rank % 2, "gpu": str(rank % 2)}
        for rank, host in enumerate(["n1", "n1", "n2", "n2"])
    ]
    policy = {"max": 2, "backoff_s": 30, "backoff_factor": 2, "on": ["node_failure"]}
    retried = job(3, "running", attempt=2, nodes="n[1-2]", placement=placement, retries=policy)
    attempts = [
        {"attempt": 1, "state": "failed", "kind": "node_failure", "nodes": "n[1-2]", "external_id": "7",
         "ended_at": "2026-01-01T00:01:00Z", "reason": "rank 3 on n2 vanished (rank 0 on n1 lost it):\n..."},
        {"attempt": 2, "state": "running", "kind": None, "nodes": "n[1-2]", "external_id": "9"},
    ]  # fmt: skip
    console = Console(file=io.StringIO(), width=200)
    console.print(job_details(retried, [], attempts))
    details = console.file.getvalue()  # type: ignore[attr-defined]

    assert "2 of at most 3" in details
    assert "0-1 on n1 (GPUs 0,1); 2-3 on n2 (GPUs 0,1)" in details
    assert "node_failure" in details and "rank 3 on n2 vanished" in details


def test_details_show_restarts_in_place_and_goodput_brought_up_to_now() -> None:
    goodput = {"training_s": 90.0, "downtime_s": 6.0, "recomputed_s": 4.0, "queue_s": 0.0, "ratio": 0.9,
               "as_of": "2026-01-01T00:00:00Z", "accruing": "training"}  # fmt: skip
    restarted = job(4, "running", restart_count=1, restarts={"max": 2, "on": ["node_failure", "hang"]},
                    goodput=goodput)  # fmt: skip
    now = datetime(2026, 1, 1, 0, 1, 40, tzinfo=timezone.utc)  # 100 s of training since as_of
    assert goodput_text(restarted, now) == (
        "95% training: training 3m10s, restart downtime 6.0s, recomputed 4.0s, queue 0.0s"
    )
    console = Console(file=io.StringIO(), width=200)
    console.print(job_details(restarted, []))
    details = console.file.getvalue()  # type: ignore[attr-defined]
    assert "1 in place (at most 2 an attempt, on node_failure, hang)" in details and "goodput" in details
    assert goodput_text(job(5, "queued")) == ""


class FakeJobs:
    """client.get() walks each job through the given states."""

    def __init__(self, timelines: dict[int, list[dict[str, Any]]]) -> None:
        self._timelines = {job_id: iter(states) for job_id, states in timelines.items()}

        self.followed: list[int] = []  # the jobs followed with wait() (long polls) rather than get()

    def get(self, job_id: int) -> dict[str, Any]:
        return next(self._timelines[job_id])

    def wait(self, job_id: int, on_update: Any, poll_s: float) -> dict[str, Any]:
        self.followed.append(job_id)
        while True:
            current = self.get(job_id)
            on_update(current)
            if current["state"] in TERMINAL_STATE_NAMES:
                return current


@pytest.mark.parametrize("terminal", [False, True])
def test_watch_jobs_follows_every_job_to_its_end(terminal: bool) -> None:
    timelines = {
        1: [
            job(1, "queued"),
            job(1, progress={"step": 5, "total": 10, "metrics": {"loss": 0.5}}),
            job(1, "succeeded"),
        ],
        2: [job(2, "running"), job(2, "failed")],
    }
    console = Console(file=io.StringIO(), force_terminal=terminal, width=120)
    client = FakeJobs(timelines)
    final = watch_jobs(client, [job(1), job(2)], console, poll_s=0)  # type: ignore[arg-type]
    assert {job_id: j["state"] for job_id, j in final.items()} == {1: "succeeded", 2: "failed"}
    assert client.followed == [1]  # job 2 ended first: the last one left was followed
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert "succeeded" in out and "failed" in out
    if not terminal:  # plain lines, one per change, progress carried to the last one
        assert "job 1 job-1: running  step 5/10 loss 0.5" in out
        assert "job 1 job-1: succeeded  step 5/10 loss 0.5" in out


# ---------------------------------------------------------------- following logs


def lines(*items: str) -> list[str]:
    return [f"{item}\n" for item in items]


@pytest.mark.parametrize(
    ("before", "window", "fresh", "overlapped"),
    [
        ([], lines("a", "b"), lines("a", "b"), True),
        (lines("a", "b"), lines("a", "b", "c"), lines("c"), True),
        (lines("a", "b"), lines("b", "c", "d"), lines("c", "d"), True),  # the window moved on
        (lines("x", "x"), lines("x", "x", "x"), lines("x"), True),  # repeated lines: the smallest shift
        (lines("a", "b"), lines("c", "d"), lines("c", "d"), False),  # more than a window was appended
        (lines("a", "b"), lines("a", "b"), [], True),
    ],
)
def test_new_part(before: list[str], window: list[str], fresh: list[str], overlapped: bool) -> None:
    assert new_part(before, window) == (fresh, overlapped)


class GrowingLog:
    def __init__(self, texts: list[str]) -> None:
        self._texts = iter(texts)

    def logs(self, job_id: int, rank: int = 0, tail: int | None = None, stream: str = "out") -> str:
        return next(self._texts)


def test_follower_prints_each_line_once_and_holds_a_partial_line_back() -> None:
    sink = io.StringIO()
    log = GrowingLog(["one\ntwo\nthr", "one\ntwo\nthree\nfour\n", "two\nthree\nfour\nfive"])
    follower = LogFollower(log, 1, 0, "out", sink)  # type: ignore[arg-type]
    follower.poll(first_tail=1)  # like --tail 1: only the last complete line of the past
    follower.poll()
    follower.poll(final=True)  # the job ended: its last partial line too
    assert sink.getvalue() == "two\nthree\nfour\nfive"


# ---------------------------------------------------------------- the demo's checks


def test_demo_checks_pass_on_the_real_evidence() -> None:
    assert check_ddp(job(1, "succeeded", result=DDP_RESULT)).ok
    assert check_sampler(job(2, "succeeded", result=SAMPLER_RESULT)).ok


@pytest.mark.parametrize(
    ("check", "result", "tamper"),
    [
        (check_ddp, DDP_RESULT, {"params_identical_after_step": False}),
        (check_ddp, DDP_RESULT, {"max_abs_diff": 0.5}),
        (check_ddp, DDP_RESULT, {"world_size": 2}),
        (check_ddp, DDP_RESULT, {"initial_params_differed_before_ddp": False}),
        (check_sampler, SAMPLER_RESULT, {"shards": {"0": [0, 1], "1": [2, 3], "2": [4, 5], "3": [6, 7]}}),
        (check_sampler, SAMPLER_RESULT, {"dataset_identical_on_all_ranks": False}),
        (check_sampler, SAMPLER_RESULT, {"shards": {"0": [0, 4], "1": [1, 5], "2": [2, 6]}}),
    ],
)
def test_demo_checks_do_not_trust_ok(
    check: Callable[..., Any], result: dict[str, Any], tamper: dict[str, Any]
) -> None:
    assert not check(job(1, "succeeded", result={**result, **tamper, "ok": True})).ok


def test_demo_checks_fail_a_failed_job_and_say_why() -> None:
    verdict = check_ddp(job(1, "failed", reason="Traceback\nRuntimeError: gloo timeout"))
    assert not verdict.ok
    assert any("RuntimeError: gloo timeout" in claim for claim, _ in verdict.checks)


# ---------------------------------------------------------------- commands against a mock service


@pytest.fixture
def mock_service(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[dict[int, dict[str, Any]]]:
    """The CLI's client talks to an in-memory service; yields its jobs by id."""
    jobs: dict[int, dict[str, Any]] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        parts = request.url.path.strip("/").split("/")[3:]  # after api/v1/jobs
        if request.method == "POST" and not parts:
            body = json.loads(request.content)
            if body.get("resources", {}).get("tasks_per_node") == 0:
                detail = [{"loc": ["body", "resources", "tasks_per_node"], "msg": "Input should be >= 1"}]
                return httpx.Response(422, json={"detail": detail})
            new = job(len(jobs) + 1, "queued", name=body["name"], spec=body)
            jobs[new["id"]] = new
            return httpx.Response(201, json=new)
        if not parts:
            return httpx.Response(200, json={"items": list(reversed(jobs.values())), "next_cursor": None})
        found = jobs.get(int(parts[0]))
        if found is None:
            return httpx.Response(404, json={"detail": [{"loc": ["job_id"], "msg": "job_id: not found"}]})
        if parts[1:] == ["cancel"]:
            found["state"] = "cancelled"
        if parts[1:] == ["events"]:
            return httpx.Response(200, json=[])
        if parts[1:] == ["logs"]:
            return httpx.Response(
                200, text=f"{request.url.params['stream']} of rank {request.url.params['rank']}\n"
            )
        return httpx.Response(200, json=found)

    transport = httpx.MockTransport(handler)
    real = TorchyardClient

    def client(base_url: str | None = None, token: str | None = None, **kwargs: Any) -> TorchyardClient:
        return real("http://mock", token=token, transport=transport)

    monkeypatch.setattr(cli_context, "TorchyardClient", client)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    yield jobs


def test_commands_against_the_mock(mock_service: dict[int, dict[str, Any]], tmp_path: Path) -> None:
    runner = CliRunner()
    spec = tmp_path / "job.yaml"
    spec.write_text("name: mocked\nentrypoint: m:f\n")
    result = runner.invoke(app, ["submit", str(spec)])
    assert result.exit_code == 0 and "submitted job 1 (mocked), queued" in result.output
    result = runner.invoke(app, ["list"])
    assert result.exit_code == 0 and "mocked" in result.output
    assert json.loads(runner.invoke(app, ["show", "1", "--json"]).output)["name"] == "mocked"
    result = runner.invoke(app, ["logs", "1", "--rank", "1"])
    assert (result.stdout, result.stderr) == ("out of rank 1\n", "err of rank 1\n")
    assert "job 1 cancelled" in runner.invoke(app, ["cancel", "1"]).output


def test_refusals_exit_2_with_the_servers_words(
    mock_service: dict[int, dict[str, Any]], tmp_path: Path
) -> None:
    runner = CliRunner()
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nentrypoint: m:f\nresources: {tasks_per_node: 0}\n")
    result = runner.invoke(app, ["submit", str(spec)])
    assert result.exit_code == EXIT_REQUEST
    assert "422: resources.tasks_per_node: Input should be >= 1" in result.stderr
    result = runner.invoke(app, ["show", "9"])
    assert result.exit_code == EXIT_REQUEST and "404" in result.stderr


def test_outcome_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert outcome(job(1, "succeeded", result={"ok": True})) == 0
    assert outcome(job(2, "failed", reason="RuntimeError: boom", exit_code=1)) == EXIT_JOB_FAILED
    assert outcome(job(3, "cancelled", reason="cancelled by user")) == EXIT_JOB_FAILED
    out = capsys.readouterr().out
    assert "reason: RuntimeError: boom" in out and "torchyard logs 2 --rank 0" in out


def test_the_cli_client_and_demo_import_no_torch() -> None:
    """The demo's process runs the service; only the ranks (other processes) may import torch."""
    modules = "service.cli.main, service.client, service.cli.demo, service.embedded"
    code = f"import sys, {modules}; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "False"
