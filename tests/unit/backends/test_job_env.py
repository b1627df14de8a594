"""The environment a job's processes start with (service.backends.job_env) and how SLURM gets it."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

import worker
from service.accounts import Account
from service.backends.job_env import JobEnvironment, stage_worker

WORKER = Path(worker.__file__).parent


def test_the_environment_is_built_from_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", "postgresql://u:secret@db/x")
    monkeypatch.setenv("PYTHONPATH", "/somewhere/a/developer/left")
    environment = JobEnvironment.build(tmp_path, "/opt/env/bin/python", ["/srv/site-code"])
    account = Account.current()
    variables = environment.variables(account)

    assert set(variables) == {
        "PATH", "HOME", "USER", "LOGNAME", "LANG", "PYTHONPATH", "PYTHONSAFEPATH", "PYTHONNOUSERSITE"
    }  # fmt: skip
    assert variables["HOME"] == account.home and variables["USER"] == account.name
    assert variables["PATH"].split(":")[0] == "/opt/env/bin"  # the job's python's folder first
    worker_root, site_code = variables["PYTHONPATH"].split(":")
    assert Path(worker_root).parent == tmp_path.resolve() / "runtime" and site_code == "/srv/site-code"
    assert "secret" not in str(variables) and "developer" not in str(variables)
    assert environment.python == "/opt/env/bin/python"
    assert JobEnvironment.build(tmp_path).python == sys.executable  # the service's own by default


def test_the_staged_worker_is_a_read_only_copy_named_by_its_content(tmp_path: Path) -> None:
    staged = stage_worker(tmp_path / "runtime")
    for source in WORKER.rglob("*.py"):
        copy = staged / "worker" / source.relative_to(WORKER)
        assert copy.read_bytes() == source.read_bytes()
        assert stat.S_IMODE(copy.stat().st_mode) == 0o644
    for folder in [tmp_path / "runtime", staged, *(p for p in staged.rglob("*") if p.is_dir())]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, folder
    assert list((staged / "worker").glob("__pycache__/launch.*.pyc"))  # compiled: jobs cannot write here
    assert stage_worker(tmp_path / "runtime") == staged  # made once
    assert [p.name for p in (tmp_path / "runtime").iterdir()] == [staged.name]
