"""Your own code on the real cluster: a project uploaded by the CLI runs `train:main` on 2 nodes, as
its owner, from the read-only copy its jobs share; editing the project after submitting changes
nothing it runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.client import TorchyardClient
from tests.integration.isolation import accounted_as, isolated_settings, job_python, live_service
from tests.integration.own_code import cli_submit, make_project, result_of, set_version
from tests.integration.slurm.conftest import scancel
from tests.support import issue_token

pytestmark = pytest.mark.slurm


def test_a_project_uploaded_by_the_cli_runs_on_two_slurm_nodes(shared_root: Path) -> None:
    proj = make_project(shared_root, tasks_per_node=1, nodes=2, backend="slurm")
    settings = isolated_settings(shared_root, "slurm")
    ids: list[str | None] = []
    try:
        with live_service(settings) as server:
            token = issue_token(server.runtime.engine, "alice", allow_code=True)
            job_id = cli_submit(server.url, token, proj / "job.yaml")
            set_version(proj, "v2")
            with TorchyardClient(server.url, token=token) as client:
                try:
                    result = result_of(client, job_id, timeout_s=300)
                finally:
                    job = client.get(job_id)
                    ids.append(job["external_id"])
    finally:
        scancel(ids)

    folder = Path(job["folder"])
    assert result["version"] == "v1"
    assert result["sum"] == 3.0 and result["world_size"] == 2
    # `code` links to the copy the snapshot's jobs share (one per account), where the ranks work
    shared = (folder / "code").resolve()
    assert shared.name == "tree" and shared.parent.parent.name == "code-copies"
    assert Path(result["cwd"]) == Path(result["path0"]).resolve() == shared
    assert result["code_writable"] is False
    assert result["executable"] == job_python()
    hosts = {json.loads((folder / "placement" / f"rank{rank}.json").read_text())["host"] for rank in (0, 1)}
    assert hosts == {"n1", "n2"}  # one rank on each node
    assert job["run_as"] == "alice" and accounted_as(job["external_id"], "alice") == "alice"
