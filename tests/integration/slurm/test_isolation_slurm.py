"""On the real cluster: jobs are queued as their owners, see only the built environment on every node,
and one user's job cannot write another's folder (tests/integration/isolation.py has the probe)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.isolation import (
    SECRET,
    accounted_as,
    check_environment,
    check_import_path,
    isolated_settings,
    live_service,
    reports,
    users,
)
from tests.integration.slurm.conftest import scancel

pytestmark = pytest.mark.slurm


def test_slurm_jobs_are_their_owners_and_see_only_the_built_environment(
    shared_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", f"postgresql://torchyard:{SECRET}@db/ledger")
    monkeypatch.setenv("SBATCH_EXPORT", "NONE")  # no SBATCH_* of the service's reaches sbatch
    settings = isolated_settings(shared_root, "slurm")
    ids: list[str | None] = []
    try:
        with live_service(settings) as server:
            alice, bob = users(server)
            first = alice.probe(shared_root, nodes=2, tasks_per_node=1)  # srun's tasks on both nodes
            ids.append(first["external_id"])
            alice_folder = Path(first["folder"])
            ledger = shared_root / "ledger.db"
            targets = [f"{alice_folder}/torch.py", str(alice_folder / "result.json"), str(ledger)]
            attack = bob.probe(shared_root, plant=targets, nodes=1, tasks_per_node=2)
            ids.append(attack["external_id"])
        # SLURM's accounting and fair share are theirs.
        owners = ((first, "alice"), (attack, "bob"))
        assert [accounted_as(job["external_id"], user) for job, user in owners] == ["alice", "bob"]
    finally:
        scancel(ids)  # only what a failed assertion left running

    for job, user, other, world in ((first, "alice", "bob", 2), (attack, "bob", "alice", 2)):
        assert job["run_as"] == user
        hosts = set()
        for report in reports(job, world):
            assert report["user"] == user
            assert report["cwd"] == job["folder"]
            check_environment(report, "slurm")
            check_import_path(report, other)
            hosts.add(report["environ"]["SLURMD_NODENAME"])
        assert len(hosts) == (2 if job is first else 1)
    (bob_view, _) = reports(attack, 2)
    assert all(outcome.startswith("refused") for outcome in bob_view["writes"].values()), bob_view["writes"]
