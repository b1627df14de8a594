"""The house's layers, as docs/architecture.md draws them, held by import-linter's contracts
(`[tool.importlinter]` in pyproject.toml): a layer imports only the layers below it (api, loops,
domain, backends, jobfs, ledger), the worker never imports the service or the web stack, the service
never imports torch, only the submitit adapter imports submitit, and only the API and the app's builder
import the web framework."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_every_import_contract_holds() -> None:
    lint = Path(sys.executable).parent / "lint-imports"
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
