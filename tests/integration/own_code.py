"""What the own-code tests share (local and SLURM): a project made by the test, two interpreters, and
the CLI submitting the project as its owner would.

The project (`proj/train.py`, `proj/model/net.py`, a `requirements.txt` nobody installs) has
`train:main` return what its rank 0 sees: the version its own module says, the all-reduced sum of the
ranks, its working directory and sys.path[0], its interpreter and which test packages it can import.
"""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path
from typing import Any

from service.client import TorchyardClient
from tests.cli_service import clean_env, torchyard_command
from tests.support import ROOT

TRAIN = """\
import importlib.util
import os
import sys

import torch
import torch.distributed as dist

from model.net import describe


def main(ctx, **kwargs):
    total = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(total)
    ctx.report(1, 1, loss=0.5)
    return {
        "version": describe(),
        "sum": total.item(),
        "world_size": ctx.world_size,
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "executable": sys.executable,
        "packages": [name for name in ("extra_pkg",) if importlib.util.find_spec(name)],
        "code_writable": os.access("train.py", os.W_OK),
        "checkpoint_dir": os.environ["TORCHYARD_CHECKPOINT_DIR"],
    }
"""


def make_project(root: Path, version: str = "v1", tasks_per_node: int = 2, nodes: int = 1,
                 backend: str = "local") -> Path:  # fmt: skip
    """proj/ with its spec (`code: .`), everyone-readable (jobs run as its owner's account)."""
    proj = root / "proj"
    (proj / "model").mkdir(parents=True, exist_ok=True)
    (proj / "train.py").write_text(TRAIN)
    (proj / "model" / "__init__.py").write_text("")
    set_version(proj, version)
    (proj / "requirements.txt").write_text("a-package-nobody-installs==0.0.1\n")
    (proj / "job.yaml").write_text(
        textwrap.dedent(f"""\
        name: own-code
        code: .
        entrypoint: train:main
        backend: {backend}
        resources: {{nodes: {nodes}, tasks_per_node: {tasks_per_node}, timeout_min: 5}}
        retries: {{max: 0}}
        """)
    )
    for path in [proj, *proj.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return proj


def set_version(proj: Path, version: str) -> None:
    (proj / "model" / "net.py").write_text(f"def describe():\n    return {version!r}\n")


def cli_submit(url: str, token: str, spec: Path, *extra: str) -> int:
    """`torchyard submit SPEC` as a user runs it; the new job's id."""
    env = clean_env(TORCHYARD_URL=url, TORCHYARD_TOKEN=token)
    done = subprocess.run([*torchyard_command(), "submit", str(spec), *extra], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "code " in done.stderr and "sha256:" in done.stderr
    return int(done.stdout.split("submitted job ")[1].split()[0])


def make_interpreter(folder: Path, job_python: str, extra_package: bool) -> str:
    """A venv of the job Python that sees its packages (a .pth: a venv of a venv would not), with
    `extra_pkg` in it when asked; no download. Its python, readable and runnable by every account."""
    subprocess.run([job_python, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    lookup = [job_python, "-c", "import site; print(site.getsitepackages()[0])"]
    theirs = subprocess.run(lookup, capture_output=True, text=True, check=True).stdout.strip()
    ours = subprocess.run([str(folder / "bin" / "python"), *lookup[1:]], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    (Path(ours) / "job_python.pth").write_text(theirs + "\n")
    if extra_package:
        (Path(ours) / "extra_pkg.py").write_text("HERE = True\n")
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() or "bin" in path.parts else 0o644)
    return str(folder / "bin" / "python")


def result_of(client: TorchyardClient, job_id: int, timeout_s: float = 240) -> dict[str, Any]:
    job = client.wait(job_id, timeout_s=timeout_s)
    assert job["state"] == "succeeded", (job["state"], job["reason"])
    value: dict[str, Any] = job["result"]
    return value
