"""Chaos on the real two-node cluster: one user's hostile jobs beside another user's healthy one cost
the other user nothing, and nothing the hostile user planted runs as root (tests/integration/chaos.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.chaos import run_chaos

pytestmark = pytest.mark.slurm


@pytest.mark.parametrize("database", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_one_users_hostile_jobs_cost_another_user_nothing_on_slurm(
    shared_root: Path, database: str, request: pytest.FixtureRequest
) -> None:
    url = None if database == "sqlite" else request.getfixturevalue("postgres_server").reset_ledger()
    run_chaos(shared_root, "slurm", url, {"nodes": 2, "tasks_per_node": 1})  # its jobs end by themselves
