"""Your own code on the local backend, for real: a project the test makes is uploaded by the CLI and
run on 2 ranks as its owner's account; editing it after submitting changes nothing the job runs; two
interpreters give two environments; an interpreter not allowed is refused."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest

from service.client import TorchyardClient
from service.config import Settings
from tests.cli_service import clean_env, torchyard_command
from tests.integration.isolation import isolated_settings, job_python, live_service
from tests.integration.own_code import (
    cli_submit,
    make_interpreter,
    make_project,
    result_of,
    set_version,
)
from tests.support import ROOT, bearer, issue_token

pytestmark = pytest.mark.integration


def own_code_settings(root: Path, backend: str) -> Settings:
    return isolated_settings(root, backend).model_copy(
        update={"allowed_pythons": [job_python(), str(root / "envs")]}
    )


def test_a_project_uploaded_by_the_cli_runs_on_two_ranks_as_it_was_when_submitted(shared_root: Path) -> None:
    proj = make_project(shared_root)
    with live_service(own_code_settings(shared_root, "local")) as server:
        token = issue_token(server.runtime.engine, "alice", allow_code=True)
        first = cli_submit(server.url, token, proj / "job.yaml")
        set_version(proj, "v2")  # the user goes on editing: the job runs what was submitted
        second = cli_submit(server.url, token, proj / "job.yaml")
        with TorchyardClient(server.url, token=token) as client:
            before, after = result_of(client, first), result_of(client, second)
            folder = Path(client.get(first)["folder"])
            snapshot = client.get(first)["spec"]["code"]
            files = client.code(snapshot)["paths"]

    assert before["version"] == "v1" and after["version"] == "v2"
    assert before["sum"] == 3.0 and before["world_size"] == 2  # 1 + 2 over the two ranks
    # `code` links to the copy the snapshot's jobs share (one per account), where the ranks work
    shared = (folder / "code").resolve()
    assert shared.name == "tree" and shared.parent.parent.name == "code-copies"
    assert Path(before["cwd"]) == Path(before["path0"]).resolve() == shared
    assert before["code_writable"] is False  # the shared copy is read-only to the job
    assert before["checkpoint_dir"] == str(folder / "checkpoints")
    assert before["executable"] == job_python()
    assert files == ["job.yaml", "model/__init__.py", "model/net.py", "requirements.txt", "train.py"]
    assert (folder / "code" / "model" / "net.py").read_text().endswith("'v1'\n")


def test_two_interpreters_give_two_environments_and_one_not_allowed_is_403(shared_root: Path) -> None:
    proj = make_project(shared_root, tasks_per_node=1)
    plain = make_interpreter(shared_root / "envs" / "plain", job_python(), extra_package=False)
    extra = make_interpreter(shared_root / "envs" / "extra", job_python(), extra_package=True)
    with live_service(own_code_settings(shared_root, "local")) as server:
        token = issue_token(server.runtime.engine, "alice", allow_code=True)
        with TorchyardClient(server.url, token=token) as client:
            code = client.upload_code(proj)
            spec = {"name": "env", "code": code, "entrypoint": "train:main", "retries": {"max": 0}}
            jobs = [client.submit({**spec, "python": python})["id"] for python in (plain, extra)]
            results = [result_of(client, job_id) for job_id in jobs]
            refused = httpx.post(f"{server.url}/api/v1/jobs", json={**spec, "python": "/usr/bin/python3"},
                                 headers=bearer(token), timeout=30)  # fmt: skip

    assert [result["executable"] for result in results] == [plain, extra]
    assert [result["packages"] for result in results] == [[], ["extra_pkg"]]
    assert refused.status_code == 403
    assert refused.json()["detail"][0]["loc"] == ["body", "python"]


def test_a_sweep_of_the_project_in_front_of_you_uploads_it_once_for_every_trial(shared_root: Path) -> None:
    proj = make_project(shared_root, tasks_per_node=1)
    (proj / "sweep.yaml").write_text(
        "name: own-sweep\n"
        "job: {code: ., entrypoint: 'train:main', backend: local, resources: {timeout_min: 5},\n"
        "      retries: {max: 0}}\n"
        "grid: {seed: [1, 2]}\n"
    )
    with live_service(own_code_settings(shared_root, "local")) as server:
        token = issue_token(server.runtime.engine, "alice", allow_code=True)
        env = clean_env(TORCHYARD_URL=server.url, TORCHYARD_TOKEN=token)
        done = subprocess.run([*torchyard_command(), "sweep", str(proj / "sweep.yaml"), "--wait"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        with TorchyardClient(server.url, token=token) as client:
            sweep = client.sweeps()["items"][0]
            jobs = [client.get(trial["job_id"]) for trial in client.sweep(sweep["id"])["trials"]]
    assert sweep["counts"] == {"succeeded": 2}
    assert len({job["spec"]["code"] for job in jobs}) == 1  # one snapshot, named by every trial
    assert all(job["result"]["version"] == "v1" for job in jobs)
    assert [job["spec"]["kwargs"] for job in jobs] == [{"seed": 1}, {"seed": 2}]
