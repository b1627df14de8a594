"""The service never pays for torch: importing the app (in a fresh interpreter) loads no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("module", ["service", "service.app", "service.runtime", "service.backends.local"])
def test_importing_the_service_does_not_import_torch(module: str) -> None:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    loaded = set(json.loads(done.stdout))

    assert module in loaded
    assert sorted(name for name in loaded if name == "torch" or name.startswith("torch.")) == []


def test_building_the_app_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from service.app import create_app\n"
        "from service.config import Settings\n"
        f"create_app(Settings(data_dir={str(tmp_path)!r}))\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )

    assert done.stdout.strip() == "False"
