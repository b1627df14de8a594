"""The local backend writes a job's pickle only through a no-link handle on its submitit folder: a job
of the same account can swap that folder for a link to any folder while the service (root) writes."""

from __future__ import annotations

from pathlib import Path

from service.backends.job_env import JobEnvironment
from service.backends.local import LocalBackend
from worker.spec import RunSpec


def test_a_submitit_folder_swapped_for_a_link_gets_no_pickle(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    spec = RunSpec(
        job_id=1, name="x", entrypoint="worker.tasks.seed:ddp_parameters", folder=str(tmp_path / "1")
    )
    Path(spec.folder).mkdir()
    spec.files.submitit.symlink_to(elsewhere, target_is_directory=True)
    backend = LocalBackend(JobEnvironment.build(tmp_path / "data"))

    outcome = backend.submit([spec])[0]

    assert not outcome.accepted
    assert "Not a directory" in str(outcome.error)
    assert list(elsewhere.iterdir()) == []
