"""The `torchyard` command as users run it: its console script, and `torchyard serve` in a subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.support import ROOT


def torchyard_command() -> list[str]:
    """The installed console script next to this Python; `python -c` if it was not installed."""
    script = Path(sys.executable).parent / "torchyard"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from service.cli.main import main; main()"]


def clean_env(own_accounts: bool = False, /, **extra: str) -> dict[str, str]:
    """This environment without a developer's TORCHYARD_* (they would point the test elsewhere).

    Jobs run as the account the tests run as, unless `own_accounts`: then the service's default
    decides (each user's own account when the service is root; see service.accounts)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TORCHYARD_") or k.startswith("TORCHYARD_TEST_")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    if not own_accounts:
        env["TORCHYARD_JOB_ACCOUNTS"] = "service"
    env.update(extra)
    return env


def create_token(env: Mapping[str, str], user: str, admin: bool = False) -> str:
    """`torchyard token create` as an operator runs it on the service host: the token on its last line.

    It works on the ledger that `env` (TORCHYARD_DATABASE_URL / TORCHYARD_DATA_DIR) names, so it can
    run before `torchyard serve` does: the ledger is created and migrated on the way.
    """
    args = [*torchyard_command(), "token", "create", "--user", user, *(["--admin"] if admin else [])]
    done = subprocess.run(args, cwd=ROOT, env=dict(env), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"torchyard token create failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip().splitlines()[-1]


@contextmanager
def serving(
    args: list[str], env: Mapping[str, str], log: Path, timeout: float = 60
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a `torchyard serve ...` command line until the block ends; ready once /healthz answers."""
    url = env["TORCHYARD_URL"]
    with log.open("wb") as sink:
        process = subprocess.Popen(args, cwd=ROOT, env=dict(env), stdout=sink, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"torchyard serve exited with {process.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"torchyard serve did not answer at {url}:\n{log.read_text()}")
            time.sleep(0.1)
        yield process
    finally:
        process.send_signal(
            signal.SIGINT
        )  # what Ctrl-C does: uvicorn shuts down, the lifespan stops the loops
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
