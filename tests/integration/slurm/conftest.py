"""The real SLURM cluster of deploy/slurm for these tests.

When sinfo cannot reach a controller, deploy/slurm/up.sh brings the cluster up, once per session (it
installs the packages the first time, then takes a few seconds). Where that cannot work (not Linux,
not root) the tests skip, or fail in strict mode (CI=true), like every missing dependency here.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from service.backends.slurm import SlurmBackend
from service.config import Settings
from tests.support import missing_dependency

REPO = Path(__file__).resolve().parents[3]
UP = REPO / "deploy" / "slurm" / "up.sh"
NODES = ["n1", "n2"]  # the layout up.sh builds: partition debug, 4 CPUs each


def _nodes() -> list[str] | None:
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sorted(set(done.stdout.split())) if done.returncode == 0 else None


@cache
def cluster_problem() -> str | None:
    """Why the test cluster is not usable, or None once it is up."""
    nodes = _nodes()
    if nodes is None:
        if sys.platform != "linux" or os.geteuid() != 0:
            return "no SLURM controller answers, and deploy/slurm/up.sh needs Linux and root"
        done = subprocess.run(["bash", str(UP)], capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            return f"deploy/slurm/up.sh failed:\n{done.stderr[-3000:]}"
        nodes = _nodes()
    if nodes != NODES:
        return f"the SLURM cluster here is not the one of deploy/slurm (nodes {nodes}, want {NODES})"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    # tryfirst: before the suite-wide check in tests/conftest.py, which only looks whether sinfo works.
    if item.get_closest_marker("slurm") is not None and (problem := cluster_problem()):
        missing_dependency(problem)


@pytest.fixture
def slurm(tmp_path: Path) -> Iterator[SlurmBackend]:
    """A SlurmBackend on a fresh data folder (under /tmp: one machine is a shared filesystem)."""
    backend = SlurmBackend(Settings(data_dir=tmp_path / "data"))
    yield backend
    backend.close()
