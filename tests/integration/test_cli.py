"""The `torchyard` command against a real `torchyard serve` (subprocess, local backend, real ranks).

Three real jobs in all (each costs seconds of torch imports): a training run and a failing job,
shared by the tests through a module fixture, and one job cancelled as soon as it is submitted.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from service.client import TorchyardClient
from tests.cli_service import clean_env, create_token, serving, torchyard_command
from tests.serving import free_port
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.integration


@dataclass
class Run:
    code: int
    out: str
    err: str

    @property
    def both(self) -> str:
        return self.out + self.err


@dataclass
class Service:
    url: str
    env: dict[str, str]

    def cli(self, *args: str, timeout: float = 180) -> Run:
        return self.cli_as(self.env, *args, timeout=timeout)

    def cli_as(self, env: dict[str, str], *args: str, timeout: float = 180) -> Run:
        done = subprocess.run(
            [*torchyard_command(), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return Run(done.returncode, done.stdout, done.stderr)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    tmp = tmp_path_factory.mktemp("cli")
    url = f"http://127.0.0.1:{free_port()}"
    env = clean_env(
        TORCHYARD_URL=url,
        TORCHYARD_DATA_DIR=str(tmp / "data"),
        TORCHYARD_TOKEN_CACHE_S="0",  # a revoked token answers 401 at once, not after the cache expires
        XDG_CONFIG_HOME=str(tmp / "config"),
        NO_COLOR="1",
    )
    env["TORCHYARD_TOKEN"] = create_token(env, "alice")  # before serve: the bootstrap works on the ledger
    port = url.rsplit(":", 1)[1]
    with serving([*torchyard_command(), "serve", "--port", port], env, tmp / "serve.log"):
        yield Service(url, env)


def submitted_id(run: Run) -> int:
    found = re.search(r"submitted job (\d+)", run.out)
    assert found, run.both
    return int(found.group(1))


@pytest.fixture(scope="module")
def train(service: Service) -> tuple[int, Run]:
    run = service.cli("submit", "examples/train.yaml", "--wait")
    return submitted_id(run), run


@pytest.fixture(scope="module")
def failing(service: Service) -> tuple[int, Run]:
    run = service.cli("submit", "examples/failing.yaml", "--wait")
    return submitted_id(run), run


def test_submit_wait_shows_progress_and_exits_0_on_success(train: tuple[int, Run]) -> None:
    job_id, run = train
    assert run.code == 0, run.both
    assert f"job {job_id} train-small: running" in run.out
    assert re.search(r"step \d+/40 loss \d", run.out), run.out  # progress as rank 0 reported it
    assert f"succeeded  job {job_id} train-small" in run.out
    assert '"ok": true' in run.out  # the result is printed


def test_submit_wait_exits_nonzero_with_the_reason_when_the_job_fails(failing: tuple[int, Run]) -> None:
    job_id, run = failing
    assert run.code == 1, run.both
    assert f"failed  job {job_id} fails-on-rank-1" in run.out
    assert f"reason: rank 1 on {os.uname().nodename} raised" in run.out, run.out
    assert "deliberate failure (rank 1)" in run.out
    assert f"torchyard logs {job_id} --rank 0" in run.out


def test_list_filters_by_state_and_name(
    service: Service, train: tuple[int, Run], failing: tuple[int, Run]
) -> None:
    everything = service.cli("list")
    assert everything.code == 0 and "train-small" in everything.out and "fails-on-rank-1" in everything.out
    only_failed = service.cli("list", "--state", "failed")
    assert "fails-on-rank-1" in only_failed.out and "train-small" not in only_failed.out
    by_name = json.loads(service.cli("list", "--name", "train", "--json").out)
    assert [job["id"] for job in by_name["items"]] == [train[0]]


def test_show_prints_the_job_its_result_and_history(service: Service, train: tuple[int, Run]) -> None:
    run = service.cli("show", str(train[0]))
    assert run.code == 0, run.both
    assert "succeeded" in run.out and "final_loss" in run.out and "history" in run.out
    assert "worker.tasks.train:train  on 1x2 ranks" in run.out
    assert json.loads(service.cli("show", str(train[0]), "--json").out)["result"]["ok"] is True


def test_logs_per_rank_and_stream(service: Service, train: tuple[int, Run], failing: tuple[int, Run]) -> None:
    rank1 = service.cli("logs", str(failing[0]), "--rank", "1", "--stream", "err")
    assert rank1.code == 0 and "RuntimeError: deliberate failure (rank 1)" in rank1.err
    assert rank1.out == ""  # --stream err: nothing on stdout
    both = service.cli("logs", str(train[0]), "--rank", "1")
    assert "global_rank=1" in both.out  # the rank's own first line on its stdout (worker.launch)
    assert "[rank 1]" in both.err  # the worker's log lines go to stderr
    tail = service.cli("logs", str(train[0]), "--stream", "out", "--tail", "2")
    assert len(tail.out.splitlines()) == 2
    followed = service.cli("logs", str(train[0]), "--follow", "--stream", "out", timeout=60)
    assert followed.code == 0 and "global_rank=0" in followed.out  # an ended job: print it all, return
    bad_rank = service.cli("logs", str(train[0]), "--rank", "5")
    assert bad_rank.code == 2 and "rank: must be between 0 and 1" in bad_rank.err


def test_cancel_stops_a_job_and_is_idempotent(service: Service, tmp_path: Path) -> None:
    spec = tmp_path / "sleep.yaml"
    spec.write_text("name: sleeper\nentrypoint: worker.tasks.faults:sleep\nkwargs: {seconds: 120}\n")
    job_id = submitted_id(service.cli("submit", str(spec)))
    first = service.cli("cancel", str(job_id))
    assert first.code == 0 and f"job {job_id}" in first.out, first.both
    with TorchyardClient(service.url, token=service.env["TORCHYARD_TOKEN"]) as client:
        wait_for(lambda: client.get(job_id)["state"] == "cancelled", 30, "the job to be cancelled")
    again = service.cli("cancel", str(job_id))
    assert again.code == 0 and f"job {job_id} cancelled" in again.out
    assert "cancelled" in service.cli("show", str(job_id)).out


def test_refusals_exit_2_and_name_the_problem(service: Service, tmp_path: Path) -> None:
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nentrypoint: worker.tasks.train:train\nresources: {tasks_per_node: 0}\n")
    bad = service.cli("submit", str(spec))
    assert bad.code == 2 and "422: resources.tasks_per_node" in bad.err, bad.both
    missing = service.cli("show", "99999")
    assert missing.code == 2 and "404" in missing.err and "not found" in missing.err
    elsewhere = service.cli("--url", f"http://127.0.0.1:{free_port()}", "list")
    assert elsewhere.code == 2 and "cannot reach torchyard" in elsewhere.err


def test_tokens_are_created_listed_and_revoked_from_the_command_line(service: Service) -> None:
    created = service.cli("token", "create", "--user", "bob")
    assert created.code == 0, created.both
    token = created.out.strip().splitlines()[-1]
    assert re.fullmatch(r"\S{20,}", token), created.out  # the token alone on its last line
    as_bob = {**service.env, "TORCHYARD_TOKEN": token}
    own = service.cli_as(as_bob, "list", "--json")
    assert own.code == 0, own.both
    assert json.loads(own.out)["items"] == []  # bob sees his own jobs only: none yet
    whoami = httpx.get(f"{service.url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
    assert whoami.status_code == 200 and whoami.json() == {"user": "bob", "admin": False}, whoami.text

    listed = service.cli("token", "list", "--ledger")
    assert listed.code == 0, listed.both
    (row,) = [line for line in listed.out.splitlines() if " bob " in line]
    assert token not in listed.out and token[:4] in row  # the first characters, never the secret
    token_id = re.search(r"^\W*(\d+)\b", row)
    assert token_id, row

    revoked = service.cli("token", "revoke", token_id.group(1), "--ledger")
    assert revoked.code == 0 and f"token {token_id.group(1)} of bob revoked" in revoked.out, revoked.both
    refused = service.cli_as(as_bob, "list")
    assert refused.code == 2 and "401" in refused.err, refused.both
    assert " bob " not in service.cli("token", "list", "--ledger").out  # revoked tokens leave the plain list
    assert " bob " in service.cli("token", "list", "--all", "--ledger").out


def test_dev_mode_refuses_to_listen_beyond_this_machine(tmp_path: Path) -> None:
    env = clean_env(TORCHYARD_DATA_DIR=str(tmp_path / "data"), NO_COLOR="1")
    done = subprocess.run(
        [*torchyard_command(), "serve", "--dev", "--host", "0.0.0.0", "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "dev mode" in done.stderr and "0.0.0.0" in done.stderr and "127.0.0.1" in done.stderr


def test_sweep_launch_wait_list_and_show(service: Service, tmp_path: Path) -> None:
    spec = tmp_path / "sweep.yaml"
    spec.write_text(
        "name: lr-grid\n"
        "job:\n"
        "  entrypoint: worker.tasks.train:train\n"
        "  kwargs: {epochs: 2, samples: 64, report_every: 1}\n"
        "grid:\n"
        "  lr: [0.3, 0.01, 0.05]\n"
        "max_parallel: 2\n"
    )
    run = service.cli("sweep", str(spec), "--wait", timeout=300)
    assert run.code == 0, run.both
    found = re.search(r"submitted sweep (\d+) \(lr-grid\): 3 trials", run.out)
    assert found, run.both
    sweep_id = int(found.group(1))
    with TorchyardClient(service.url, token=service.env["TORCHYARD_TOKEN"]) as client:
        sweep = client.sweep(sweep_id)
    assert sweep["counts"] == {"succeeded": 3}
    # The final table lists the trials best first: job ids in the order of their last loss.
    ranked = sorted(sweep["trials"], key=lambda trial: trial["metric_last"])
    rows = [int(m.group(1)) for m in re.finditer(r"^\s*(\d+)( \*)?[\s│]+lr=", run.out, re.MULTILINE)]
    assert rows[-3:] == [trial["job_id"] for trial in ranked], run.out
    assert re.search(rf"^\s*{sweep['best']['job_id']} \*", run.out, re.MULTILINE), run.out  # the best, marked

    listed = service.cli("sweeps")
    row = rf"^\s*{sweep_id}[\s│]+lr-grid[\s│]+3[\s│]+finished"
    assert listed.code == 0 and re.search(row, listed.out, re.MULTILINE), listed.both
    shown = service.cli("sweep", "show", str(sweep_id))
    assert shown.code == 0 and "3 succeeded" in shown.out and "lr=0.3" in shown.out, shown.both
    assert service.cli("sweep", "show").code == 2  # no id: refused with a message
    missing = service.cli("sweep", "show", "999")
    assert missing.code == 2 and "sweep 999 not found" in missing.err, missing.both
    unpruned = service.cli("sweep", "resume", str(sweep_id), "--trial", "0")  # it succeeded: not resumed
    assert unpruned.code != 0 and "trial 0" in unpruned.err, unpruned.both
    assert "not stopped early" in unpruned.err, unpruned.both
    no_trial = service.cli("sweep", "resume", str(sweep_id))
    assert no_trial.code == 2 and "--trial" in no_trial.err, no_trial.both
