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


WEB_FRAMEWORK = ("fastapi", "starlette")
SERVER_STACK = ("fastapi", "starlette", "sqlmodel", "sqlalchemy", "uvicorn", "alembic", "torch")
# What the CLI and the client may import from the service at module level: each other and the states.
CLIENT_SIDE = ("service.client", "service.cli", "service.states", "service.code_pack")


def imports(path: Path, *, module_level_only: bool) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`; with module_level_only, those that run on import
    (not inside a function, nor under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = list(ast.walk(tree)) if not module_level_only else list(_module_level(tree.body))
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def _module_level(body: list[ast.stmt]) -> list[ast.stmt]:
    statements = []
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.If | ast.Try | ast.With):
            inner = [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            statements += _module_level(inner)
        elif not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            statements.append(node)
    return statements


def test_only_the_api_and_the_app_builder_import_the_web_framework() -> None:
    offenders = [
        f"{path.relative_to(REPO)}:{line} {name}"
        for path in sorted((REPO / "service").rglob("*.py"))
        if not (path.is_relative_to(REPO / "service" / "api") or path == REPO / "service" / "app.py")
        for line, name in imports(path, module_level_only=False)
        if name.split(".")[0] in WEB_FRAMEWORK
    ]
    assert not offenders


def test_the_cli_and_the_client_import_no_server_module_at_start() -> None:
    """`serve`, `demo` and the admin verbs (`token`, `quota`) run the server or open the ledger: they
    import what they need inside the verb. Everything else the CLI does goes through the client."""
    files = [*sorted((REPO / "service" / "client").rglob("*.py"))]
    files += sorted((REPO / "service" / "cli").rglob("*.py"))
    offenders = [
        f"{path.relative_to(REPO)}:{line} {name}"
        for path in files
        for line, name in imports(path, module_level_only=True)
        if (name.split(".")[0] == "service" and not name.startswith(CLIENT_SIDE))
        or name.split(".")[0] in SERVER_STACK
    ]
    assert not offenders


@pytest.mark.parametrize("module", ["service.client", "service.cli.main"])
def test_the_client_and_the_cli_load_without_the_server_stack(module: str) -> None:
    loaded = modules_after_import(module)
    assert module in loaded
    assert not {name for name in loaded if name.split(".")[0] in SERVER_STACK}
