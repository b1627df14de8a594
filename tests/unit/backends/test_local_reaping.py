"""Every controller the local backend starts is reaped, however its job ends (issue 43, finding 8).

The reconciler stops polling a job once the ledger has its ending: a job ended by a rank's error file,
or cancelled, is never polled again. A backend that reaped only when polled left each such controller a
zombie child of the service: one more per failed or cancelled job, for as long as the service ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import service.backends.local as local
from service.backends import make_backends
from service.backends.base import Backend
from service.config import Settings
from tests.support import wait_for
from worker.spec import RunSpec

GRACE_S = 0.3  # the cancel's SIGKILL comes this long after its SIGINT (3 s in the service)
FAILING, CANCELLED = 5, 5


@pytest.fixture
def backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Backend]:
    monkeypatch.setattr(local, "CANCEL_GRACE_S", GRACE_S)

    def start(self: object, spec: RunSpec) -> subprocess.Popen[bytes]:
        """A controller that fails after a moment (its rank raised), or runs until it is cancelled."""
        code = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(1)"
        lasts = "0.2" if spec.name == "failing" else "60"
        return subprocess.Popen([sys.executable, "-c", code, lasts], start_new_session=True)

    monkeypatch.setattr(local.LocalBackend, "_start", start)
    settings = Settings(data_dir=tmp_path / "data", backends=["local"], job_accounts="service")
    built = make_backends(settings)["local"]
    yield built
    built.close()


def zombie_children(pids: list[int]) -> list[int]:
    """Those of `pids` that are zombies whose parent is this process (the service's, in the service)."""
    found = []
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # reaped and gone
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            found.append(pid)
    return found


def test_failed_and_cancelled_local_jobs_leave_no_zombie(backend: Backend, tmp_path: Path) -> None:
    specs = [
        RunSpec(job_id=n, name="failing" if n < FAILING else "cancelled",
                entrypoint="worker.tasks.faults:sleep", folder=str(tmp_path / "jobs" / str(n)))
        for n in range(FAILING + CANCELLED)
    ]  # fmt: skip
    ids = [outcome.external_id for outcome in backend.submit(specs)]
    assert all(ids)
    external_ids = [str(one) for one in ids]
    # The reconciler's one look while they run; then each ends as the ledger sees it, never polled again.
    assert all(status.state.value == "running" for status in backend.poll(external_ids).values())
    backend.cancel(external_ids[FAILING:])
    pids = [int(one) for one in external_ids]

    wait_for(lambda: all(_state(pid) in ("Z", "gone") for pid in pids), GRACE_S + 10, "every job to end")
    wait_for(lambda: not zombie_children(pids), 10, f"no zombie children (now {zombie_children(pids)})")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
