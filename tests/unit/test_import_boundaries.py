"""The house's import rules, checked: the service side never pays for torch, the worker never
reaches into the service. Each check runs in a fresh interpreter, so nothing this test process
already imported can hide a violation."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN_IN_WORKER = ("service", "fastapi", "sqlmodel", "sqlalchemy", "starlette", "uvicorn")


def modules_after_import(module: str) -> set[str]:
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                          check=True)
    return set(json.loads(done.stdout))


@pytest.mark.parametrize("module", ["worker.launch", "worker.spec", "worker.distributed",
                                    "worker.rendezvous"])
def test_worker_entry_modules_do_not_import_torch(module: str) -> None:
    loaded = modules_after_import(module)
    assert module in loaded
    assert not {name for name in loaded if name == "torch" or name.startswith("torch.")}
    assert not {name for name in loaded if name.split(".")[0] == "submitit"}, "submitit only inside methods"


def test_worker_never_imports_the_service_or_web_stack() -> None:
    offenders = []
    for path in sorted((REPO / "worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            offenders += [f"{path.relative_to(REPO)}:{node.lineno} {name}" for name in names
                          if name.split(".")[0] in FORBIDDEN_IN_WORKER]
    assert not offenders


@pytest.mark.skipif(importlib.util.find_spec("service.app") is None, reason="service.app not written yet")
def test_service_app_does_not_import_torch() -> None:
    loaded = modules_after_import("service.app")
    assert not {name for name in loaded if name == "torch" or name.startswith("torch.")}
