"""The local backend's tests, and the backend they drive, signal only their own processes.

Twice, processes all over a shared machine died while the suite ran. The cause was a cleanup in
test_local_submit.py: `kill -9 -<controller PID>` through the `kill` program. procps-ng's kill as
Debian 12 ships it (4.0.2) reads a negative PID written after a signal option by its first digit only:
`kill -9 -12345` is kill(-1, SIGKILL), every process root may signal, and `kill -9 -23456` is
kill(-2, SIGKILL). Run as root with a controller's PID starting with 1, the test killed everything
but init. Here those tests run in a PID namespace of their own, whose PIDs are made to start with 1,
beside a bystander that must outlive them. The other guard is static: nothing runs that program.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT

DRIVEN = ["tests/unit/backends/test_local_submit.py", "tests/unit/backends/test_local_signals.py"]
# The kill program named first in an argument vector, by its name or its path in /bin or /usr/bin.
KILL_PROGRAM = re.compile(r"""[\[(]\s*["'](?:/usr)?(?:/bin/)?kill["']\s*,""")


def _pid_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0


@pytest.mark.skipif(not _pid_namespaces(), reason="a PID namespace of its own needs root (unshare)")
def test_the_local_backend_tests_leave_every_other_process_alone(tmp_path: Path) -> None:
    log = tmp_path / "inner.log"
    script = "\n".join([
        "setsid sleep 600 & bystander=$!",  # every other process on the machine
        "for _ in $(seq 100); do /bin/true; done",  # the controllers' PIDs now start with 1
        f"{sys.executable} -m pytest -p no:cacheprovider -q --basetemp={tmp_path / 'inner'} "
        f"{' '.join(DRIVEN)} > {log} 2>&1",
        'echo "inner pytest: $?"',
        'kill -0 "$bystander" && echo "bystander alive"',
        'kill "$bystander"',
    ])  # fmt: skip
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", script],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )  # fmt: skip

    assert "bystander alive" in done.stdout, f"{done.stdout}{done.stderr}\n{log.read_text()}"
    assert "inner pytest: 0" in done.stdout, log.read_text()


def test_no_code_runs_the_kill_program() -> None:
    """os.kill and os.killpg take the PID as a number; the program takes text, and misreads it."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for folder in ("service", "worker", "tests", "bench", "deploy")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if KILL_PROGRAM.search(line)
    ]
    assert found == []
