"""What the isolation tests share: the accounts alice and bob, a place they can reach, and a probe job.

They need root (to start jobs as alice and bob), the two accounts (deploy/slurm/up.sh makes them) and
a Python every account can run (deploy/job-python.sh; deploy/test.sh passes its path in
TORCHYARD_TEST_JOB_PYTHON). Where one is missing they skip, or fail in strict mode.

The probe (tests/data/probe_rank.py) runs in script mode: every rank writes report-rank<R>.json into
its job's folder with its user, working directory, environment, sys.path, torch's file and the
outcome of each write it was asked to try.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.states import TERMINAL_STATE_NAMES
from tests.serving import LiveServer, serve
from tests.support import ROOT, bearer, issue_token, missing_dependency, wait_for

ACCOUNTS = ("alice", "bob")
DEFAULT_JOB_PYTHON = "/opt/torchyard/job-python/bin/python"
PROBE = ROOT / "tests" / "data" / "probe_rank.py"
SECRET = "canary-secret-of-the-service"

# What every rank's environment may hold, whatever the backend: the base the service builds
# (service.backends.job_env), what the worker sets, and the rank variables torchrun would set.
BASE_KEYS = {
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "PYTHONPATH", "PYTHONSAFEPATH", "PYTHONNOUSERSITE",
    "TMPDIR", "TORCHYARD_JOB_DIR", "TORCHYARD_CHECKPOINT_DIR", "OMP_NUM_THREADS",
    # worker.runner.identity_vars: the job, its run (for experiment trackers) and attempt, its upstream
    "TORCHYARD_JOB_ID", "TORCHYARD_RUN_ID", "TORCHYARD_ATTEMPT", "TORCHYARD_UPSTREAM",
    # worker.supervisor: which run of the ranks in the allocation, and the requeues before it
    "TORCHYARD_RUN", "TORCHYARD_REQUEUES",
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
}  # fmt: skip
# What the scheduler adds: submitit's local controller, or SLURM (SLURM_*, SLURMD_NODENAME, SRUN_DEBUG).
SCHEDULER_PREFIXES = {"local": ("SUBMITIT_",), "slurm": ("SLURM", "SRUN_", "SUBMITIT_")}
# SLURM's batch step adds ENVIRONMENT, HOSTNAME and TMPDIR, and its bash PWD, SHLVL and `_`, which srun
# passes on with the rest of the batch script's environment.
SCHEDULER_KEYS = {
    "local": {"CUDA_VISIBLE_DEVICES"},
    # The batch script's own, for the job's supervisor (worker.spec: SRUN_ENV, RANK_OUTPUT_ENV, ...).
    "slurm": {"ENVIRONMENT", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "TORCHYARD_SRUN",
              "TORCHYARD_RANK_OUTPUT", "TORCHYARD_RANK_ERROR"},
}


def job_python() -> str:
    return os.environ.get("TORCHYARD_TEST_JOB_PYTHON", DEFAULT_JOB_PYTHON)


def isolation_problem() -> str | None:
    """Why jobs cannot be started as alice and bob here, or None."""
    if os.geteuid() != 0:
        return "starting jobs as other accounts needs root"
    for name in ACCOUNTS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            return f"no Unix account {name} (deploy/slurm/up.sh makes alice and bob)"
    python = job_python()
    probe = ["setpriv", "--reuid=alice", "--regid=alice", "--init-groups", "--", python, "-c",
             "import torch, submitit, pydantic"]  # fmt: skip
    done = subprocess.run(probe, capture_output=True, text=True, timeout=120, check=False)
    if done.returncode != 0:
        why = done.stderr[-500:]
        return f"alice cannot run {python} with torch and submitit (deploy/job-python.sh): {why}"
    return None


@pytest.fixture
def shared_root() -> Iterator[Path]:
    """A folder every account can reach (pytest's own temporary folders are root's alone), holding
    the probe script in an allowed script folder. Removed afterwards."""
    if problem := isolation_problem():
        missing_dependency(problem)
    root = Path(tempfile.mkdtemp(prefix="torchyard-isolation-", dir="/var/tmp"))
    root.chmod(0o711)
    scripts = root / "scripts"
    scripts.mkdir(mode=0o755)
    scripts.chmod(0o755)
    shutil.copyfile(PROBE, scripts / PROBE.name)
    (scripts / PROBE.name).chmod(0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def isolated_settings(root: Path, backend: str) -> Settings:
    """A service that runs each user's jobs as their own account: the default, spelled out."""
    return Settings(
        job_accounts="owner",
        job_python=job_python(),
        default_backend=backend,
        data_dir=root / "data",
        database_url=f"sqlite:///{root / 'ledger.db'}",
        allowed_script_dirs=[str(root / "scripts")],
        reconcile_interval_s=0.5,
        local_reconcile_interval_s=0.05,
        dispatch_interval_s=0.05,
        rendezvous_timeout_s=60,
    )


@dataclass
class User:
    """One token holder talking to the live service."""

    server: LiveServer
    name: str
    token: str

    @property
    def headers(self) -> dict[str, str]:
        return bearer(self.token)

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.server.url}/api/v1/jobs", json=body, headers=self.headers, timeout=60)

    def job(self, job_id: int) -> dict[str, Any]:
        response = httpx.get(f"{self.server.url}/api/v1/jobs/{job_id}", headers=self.headers, timeout=30)
        value: dict[str, Any] = response.raise_for_status().json()
        return value

    def probe(self, root: Path, plant: Sequence[str] = (), **resources: int) -> dict[str, Any]:
        """Run the probe script to its end; the job as the API shows it."""
        args = [item for path in plant for item in ("--plant", path)]
        body = {"name": f"probe-{self.name}", "script": str(root / "scripts" / PROBE.name), "args": args,
                "resources": {"timeout_min": 5, **resources}}  # fmt: skip
        response = self.post(body)
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]

        def ended() -> dict[str, Any] | None:
            one = self.job(job_id)
            return one if one["state"] in TERMINAL_STATE_NAMES else None

        return wait_for(ended, 180, f"{self.name}'s probe job {job_id} to end")


def users(server: LiveServer) -> tuple[User, User]:
    engine = server.app.state.runtime.engine
    alice, bob = (User(server, name, issue_token(engine, name)) for name in ACCOUNTS)
    return alice, bob


def live_service(settings: Settings) -> Any:
    return serve(create_app(settings))


def reports(job: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every rank's report of a probe job that succeeded."""
    assert job["state"] == "succeeded", (job["state"], job["reason"])
    folder = Path(job["folder"])
    found: list[dict[str, Any]] = []
    for rank in range(world_size):
        path = folder / f"report-rank{rank}.json"
        wait_for(path.exists, 10, f"{path}")  # a rank may finish writing just after rank 0's result
        found.append(json.loads(path.read_text()))
    return found


def check_environment(report: dict[str, Any], backend: str) -> None:
    """Nothing but the built base, the worker's and the scheduler's variables, and no service secret."""
    environ: dict[str, str] = report["environ"]
    prefixes = SCHEDULER_PREFIXES[backend]
    unexpected = sorted(
        key for key in environ
        if key not in BASE_KEYS | SCHEDULER_KEYS[backend] and not key.startswith(prefixes)
    )  # fmt: skip
    assert not unexpected, f"a {backend} rank's environment holds {unexpected}"
    settings = {f"TORCHYARD_{name.upper()}" for name in Settings.model_fields}
    assert not settings & set(environ), "a service setting reached a rank"
    assert not any(SECRET in value for value in environ.values())
    assert environ["PYTHONSAFEPATH"] == "1" and environ["PYTHONNOUSERSITE"] == "1"
    assert environ["HOME"] == pwd.getpwnam(report["user"]).pw_dir
    assert environ["TORCHYARD_JOB_DIR"] == report["cwd"]  # it works in its own folder


def check_import_path(report: dict[str, Any], other: str) -> None:
    """torch is the interpreter's own, and no folder on sys.path can be written by `other`'s jobs."""
    environment = Path(job_python()).parent.parent  # the venv deploy/job-python.sh made
    assert Path(report["torch_file"]).is_relative_to(environment), report["torch_file"]
    assert "" not in report["sys_path"] and report["cwd"] not in report["sys_path"]
    uid = pwd.getpwnam(other).pw_uid
    for entry in report["sys_path"]:
        path = Path(entry)
        if not path.exists():
            continue
        stat = path.stat()
        assert stat.st_uid != uid and not stat.st_mode & 0o002, f"{other} can write {entry} on sys.path"


def accounted_as(external_id: str, user: str, timeout: float = 60) -> str:
    """Wait until SLURM's accounting lists the job as `user`'s; what it last said.

    slurmdbd (22.05) first records a job as uid 0 and writes its real owner a few seconds after the
    job ended, so a first look can say root: wait for the record to settle rather than read it once.
    """
    deadline = time.monotonic() + timeout
    while True:
        done = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "User", "-j", external_id],
                              capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
        said = done.stdout.strip()
        if said == user or time.monotonic() > deadline:
            return said
        time.sleep(0.5)
