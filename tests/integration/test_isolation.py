"""A job cannot touch the service, its secrets, or another user's jobs: the local backend, for real.

bob is the hostile user with an ordinary token. The service runs as root (as on a shared host), its
own environment holds a secret and a developer's PYTHONPATH with a planted torch.py; alice and bob
each run probe jobs (tests/integration/isolation.py) that report what their ranks see and can write.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import httpx
import pytest

from service.states import TERMINAL_STATE_NAMES
from tests.integration.isolation import (
    SECRET,
    check_environment,
    check_import_path,
    isolated_settings,
    live_service,
    reports,
    users,
)

pytestmark = pytest.mark.integration


def test_the_torch_logs_attack_is_refused_at_the_door(shared_root: Path) -> None:
    """Step 1 of the attack: TORCH_LOGS_OUT would have written a torch.py where the next job looks."""
    attack = {
        "TORCH_LOGS": "+distributed",
        "TORCH_LOGS_OUT": f"{os.getcwd()}/torch.py",
        "TORCH_LOGS_FORMAT": "import os; os.system('id') #%(message)s",
    }
    with live_service(isolated_settings(shared_root, "local")) as server:
        _, bob = users(server)
        response = bob.post({"name": "attack", "entrypoint": "worker.tasks.seed:ddp_step", "env": attack})
        listed = httpx.get(f"{server.url}/api/v1/jobs", headers=bob.headers, timeout=30).json()
    assert response.status_code == 403, response.text
    (problem,) = response.json()["detail"]
    assert problem["loc"][:2] == ["body", "env"] and problem["loc"][2] in attack
    assert "allow-list" in problem["msg"]
    assert listed["items"] == []  # nothing stored
    assert not Path(os.getcwd(), "torch.py").exists()


def test_jobs_run_as_their_owners_in_a_built_environment_and_cannot_reach_each_other(
    shared_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    planted = shared_root / "planted"
    planted.mkdir(mode=0o755)
    (planted / "torch.py").write_text("raise SystemExit('planted torch imported')\n")
    planted.chmod(0o755)
    # What a service's environment holds and no job may see: a secret, and a developer's PYTHONPATH.
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", f"postgresql://torchyard:{SECRET}@db/ledger")
    monkeypatch.setenv("PYTHONPATH", str(planted))
    settings = isolated_settings(shared_root, "local")
    data = settings.data_dir

    with live_service(settings) as server:
        alice, bob = users(server)
        first = alice.probe(shared_root, tasks_per_node=2)
        alice_folder = Path(first["folder"])
        alice_result = (alice_folder / "result.json").read_bytes()
        ledger = shared_root / "ledger.db"
        worker_copy = next((data / "runtime").glob("worker-*")) / "worker"
        targets = {
            "own": "torch.py",  # its own working directory: allowed, and must not matter
            "service cwd": f"{os.getcwd()}/torch.py",
            "jobs root": f"{data / 'jobs'}/torch.py",
            "data dir": f"{data}/torch.py",
            "alice's folder": f"{alice_folder}/torch.py",
            "alice's result": str(alice_folder / "result.json"),
            "alice's progress": str(alice_folder / "progress.jsonl"),
            "alice's pickles": str(next((alice_folder / "submitit").glob("*_submitted.pkl"))),
            "the ledger": str(ledger),
            "the staged worker": str(worker_copy / "launch.py"),
            "the planted folder": f"{planted}/extra.py",
        }
        attack = bob.probe(shared_root, plant=list(targets.values()), tasks_per_node=2)
        second = alice.probe(shared_root, tasks_per_node=2)
        health = httpx.get(f"{server.url}/healthz", timeout=10)

    (bob_view, _) = reports(attack, 2)
    written = {name: bob_view["writes"][path] for name, path in targets.items()}
    assert written.pop("own") == "written"
    assert all(outcome.startswith("refused") for outcome in written.values()), written
    assert (alice_folder / "result.json").read_bytes() == alice_result
    assert health.status_code == 200, health.text  # the ledger is whole

    for job, user, other in ((first, "alice", "bob"), (attack, "bob", "alice"), (second, "alice", "bob")):
        assert job["run_as"] == user
        for report in reports(job, 2):
            assert report["user"] == user
            assert report["cwd"] == job["folder"]
            check_environment(report, "local")
            check_import_path(report, other)
            assert str(planted) not in report["environ"]["PYTHONPATH"]
        folder = Path(job["folder"]).stat()
        assert stat.S_IMODE(folder.st_mode) == 0o700 and folder.st_uid == _uid(user)

    assert stat.S_IMODE(ledger.stat().st_mode) == 0o600
    assert stat.S_IMODE(data.stat().st_mode) == 0o711
    assert stat.S_IMODE((data / "jobs").stat().st_mode) == 0o711
    assert first["state"] in TERMINAL_STATE_NAMES


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid
