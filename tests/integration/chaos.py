"""The chaos test's parts: one user's jobs do every hostile thing issue 35 found at once, beside another
user's healthy jobs, on a service that runs as root (tests/integration/isolation.py has the accounts).

bob is the hostile user. His jobs (tests/data/hostile_rank.py) write digits that str.isdigit() takes
and int() refuses, NUL and lone surrogates, thousands of sparse error files, a flood of metrics, and
rename the service's pickles to scheduler options; one of them runs an interpreter from a folder bob
owns, in which he planted a `setpriv` and every scheduler command, each of which would leave a mark
if the service ran it. alice's jobs are the seed's ordinary DDP job. The healthy job must be accepted,
run and succeed about as fast as alone; every hostile job must end; the service's memory must stay
bounded; and nothing bob planted may run as root.
"""

from __future__ import annotations

import os
import pwd
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from service.config import Settings
from service.states import TERMINAL_STATE_NAMES
from tests.integration.isolation import User, isolated_settings, job_python, live_service, users
from tests.support import ROOT, wait_for

HOSTILE = ROOT / "tests" / "data" / "hostile_rank.py"
# What bob's jobs do (hostile_rank.py), and how each ends: with an error of its own, or by exiting 0.
DOINGS = {
    "superscript-rank": 1,
    "superscript-attempt": 1,
    "nul-in-error": 1,
    "surrogate-checkpoint": 0,
    "sparse-error-files": 0,
    "metric-flood": 0,
    "renamed-pickles": 0,
}
PLANTED = ("setpriv", "sbatch", "squeue", "sacct", "scancel", "scontrol")
HEALTHY = {"name": "healthy", "entrypoint": "worker.tasks.seed:ddp_parameters"}
MAX_GROWTH = 256 << 20  # bytes the service's process may grow by while bob's jobs run


def chaos_settings(root: Path, backend: str, database_url: str | None) -> Settings:
    """isolation's service, with bob's own interpreter allowed, on `database_url` (default SQLite)."""
    settings = isolated_settings(root, backend)
    update: dict[str, Any] = {"allowed_pythons": [job_python(), str(bobs_python(root))]}
    if database_url is not None:
        update["database_url"] = database_url
    return settings.model_copy(update=update)


def bobs_python(root: Path) -> Path:
    return root / "bob-env" / "bin" / "python"


def plant_bobs_environment(root: Path) -> Path:
    """A project environment of bob's (his folder, his links to the job Python and its packages), whose
    bin/ holds a `setpriv` and every scheduler command: each leaves `ran-<name>-as-<uid>` in `root`
    and then does what the real one would. Returns where the marks go."""
    env = root / "bob-env"
    real = Path(job_python()).parent.parent  # deploy/job-python.sh's venv
    site = f"lib/python{_python_version(real)}/site-packages"
    (env / "bin").mkdir(parents=True)
    (env / site).parent.mkdir(parents=True)
    (env / "pyvenv.cfg").write_text((real / "pyvenv.cfg").read_text())
    (env / site).symlink_to(real / site)
    (env / "bin" / "python").symlink_to(os.path.realpath(job_python()))
    marks = root / "marks"
    marks.mkdir(mode=0o777)
    marks.chmod(0o777)  # whoever runs a planted command can leave its mark
    for name in PLANTED:
        found = shutil.which(name)
        tool = env / "bin" / name
        tool.write_text(f'#!/bin/sh\ntouch {marks}/ran-{name}-as-$(id -u)\nexec {found} "$@"\n')
        tool.chmod(0o755)
    bob = pwd.getpwnam("bob")
    for path in (env, *env.rglob("*")):
        os.chown(path, bob.pw_uid, bob.pw_gid, follow_symlinks=False)
    return marks


def _python_version(venv: Path) -> str:
    for line in (venv / "pyvenv.cfg").read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "version":
            return ".".join(value.strip().split(".")[:2])
    raise AssertionError(f"no version in {venv / 'pyvenv.cfg'}")


def hostile_bodies(root: Path) -> list[dict[str, Any]]:
    script = str(root / "scripts" / HOSTILE.name)
    resources = {"timeout_min": 5, "tasks_per_node": 1}
    bodies: list[dict[str, Any]] = [
        {
            "name": f"hostile-{doing}",
            "script": script,
            "args": [doing, "--exit", str(code)],
            "resources": resources,
        }
        for doing, code in DOINGS.items()
    ]
    bodies.append({
        "name": "hostile-planted-tools", "script": script, "args": ["nothing"], "resources": resources,
        "python": str(bobs_python(root)),
    })  # fmt: skip
    return bodies


def stage_hostile_script(root: Path) -> None:
    shutil.copyfile(HOSTILE, root / "scripts" / HOSTILE.name)
    (root / "scripts" / HOSTILE.name).chmod(0o644)


def run_to_end(user: User, body: dict[str, Any], timeout: float = 240) -> tuple[dict[str, Any], float]:
    """Submit `body` and wait for its end: the job as the API shows it, and how long it took."""
    started = time.monotonic()
    response = user.post(body)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    return wait_until_ended(user, job_id, timeout), time.monotonic() - started


def wait_until_ended(user: User, job_id: int, timeout: float = 240) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        one = user.job(job_id)
        return one if one["state"] in TERMINAL_STATE_NAMES else None

    return wait_for(ended, timeout, f"{user.name}'s job {job_id} to end")


@dataclass
class MemoryWatch:
    """The largest resident size this process (the service's) reached, sampled every 50 ms."""

    start: int = 0
    peak: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def growth(self) -> int:
        return self.peak - self.start


@contextmanager
def watching_memory() -> Iterator[MemoryWatch]:
    watch = MemoryWatch(start=_rss(), peak=_rss())

    def sample() -> None:
        while not watch._stop.wait(0.05):
            watch.peak = max(watch.peak, _rss())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        watch._stop.set()
        thread.join(5)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def check_chaos(
    healthy_alone: float,
    healthy: tuple[dict[str, Any], float],
    hostile: list[dict[str, Any]],
    marks: Path,
    memory: MemoryWatch,
) -> None:
    """What the chaos test holds the service to."""
    job, took = healthy
    assert job["state"] == "succeeded", (job["state"], job["reason"])
    assert took <= 3 * healthy_alone + 30, f"the healthy job took {took:.1f} s, {healthy_alone:.1f} s alone"
    ends = {one["name"]: (one["state"], one["reason"]) for one in hostile}
    assert all(one["state"] in TERMINAL_STATE_NAMES for one in hostile), ends
    for one in hostile:
        assert "\x00" not in (one["reason"] or "")
    nul_state, nul_reason = ends["hostile-nul-in-error"]
    assert nul_state == "failed" and "ValueError" in (nul_reason or ""), (
        "hostile-nul-in-error",
        nul_state,
        nul_reason,
    )
    assert ends["hostile-planted-tools"][0] == "succeeded", ends["hostile-planted-tools"]
    as_root = sorted(mark.name for mark in marks.iterdir() if mark.name.endswith("-as-0"))
    assert not as_root, f"planted programs ran as root: {as_root}"
    assert memory.growth < MAX_GROWTH, f"the service grew by {memory.growth >> 20} MiB"


def run_chaos(
    root: Path, backend: str, database_url: str | None, healthy_resources: dict[str, int]
) -> list[str]:
    """The whole scene on `backend`; returns the scheduler ids it used (for a SLURM test to clean up)."""
    stage_hostile_script(root)
    marks = plant_bobs_environment(root)
    healthy = {**HEALTHY, "resources": {"timeout_min": 5, **healthy_resources}}
    with live_service(chaos_settings(root, backend, database_url)) as server:
        alice, bob = users(server)
        alone, alone_s = run_to_end(alice, healthy)  # the time it takes without bob
        assert alone["state"] == "succeeded", alone["reason"]
        with watching_memory() as memory:
            submitted = [bob.post(body) for body in hostile_bodies(root)]
            assert [response.status_code for response in submitted] == [201] * len(submitted), [
                response.text for response in submitted
            ]
            beside = run_to_end(alice, healthy)
            hostile = [wait_until_ended(bob, response.json()["id"]) for response in submitted]
    check_chaos(alone_s, beside, hostile, marks, memory)
