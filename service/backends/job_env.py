"""The environment a job's processes start with: built from nothing, never the service's own.

A job is untrusted code. Nothing of the service's environment (its database URL, its tokens, a
developer's PYTHONPATH) reaches a rank: every backend starts a job's processes with exactly
`JobEnvironment.variables(account)` (on SLURM, `sbatch` runs with it, and its default --export=ALL
passes exactly that on; see SlurmBackend._sbatch). On top of that base the scheduler adds its own
variables (SLURM_*, submitit's), the worker adds the rank's (RANK, MASTER_PORT, ..., TORCHYARD_JOB_DIR,
TMPDIR) and the spec's allow-listed `env` (service.domain.policy).

The ranks import `worker` from a copy the service stages under `<data dir>/runtime/` (owned by the
service, read-only to jobs), so that neither the service's installation nor anything a job can write
is on a rank's import path, and PYTHONSAFEPATH keeps the working directory off it too.
"""

from __future__ import annotations

import compileall
import hashlib
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from service.accounts import Account

STANDARD_PATH = ("/usr/local/bin", "/usr/bin", "/bin")
RUNTIME_MODE = 0o755  # jobs of every account read the staged worker; only the service writes it


@dataclass(frozen=True)
class JobEnvironment:
    """What every job of this service starts with: its interpreter, import path and PATH."""

    python: str
    pythonpath: tuple[str, ...]  # the staged worker first, then the operator's folders
    path: tuple[str, ...]

    @classmethod
    def build(
        cls,
        data_dir: Path,
        python: str | None = None,
        pythonpath: Sequence[str] = (),
        tools: Sequence[str] = (),
    ) -> JobEnvironment:
        """For jobs run by `python` (default: the service's), with the operator's `pythonpath`
        folders after the worker, and the folders of these `tools` (srun...) on PATH."""
        # Absolute (not resolved: a venv's bin/python is a link): it follows setpriv, which would look
        # a relative name up on the job's PATH.
        python = os.path.abspath(python or sys.executable)
        worker_root = stage_worker(data_dir.resolve() / "runtime")
        folders = [str(Path(python).parent)]
        folders += [str(Path(found).parent) for tool in tools if (found := shutil.which(tool))]
        path = tuple(dict.fromkeys([*folders, *STANDARD_PATH]))
        extra = tuple(str(Path(folder).resolve()) for folder in pythonpath)
        return cls(python=python, pythonpath=(str(worker_root), *extra), path=path)

    def with_python(self, python: str | None) -> JobEnvironment:
        """The same environment for a job that names its own interpreter (`JobCreate.python`, allowed
        at admission): that interpreter, its folder first on PATH. The staged worker stays first on
        the import path, so the interpreter needs torch and submitit, not torchyard."""
        if python is None or python == self.python:
            return self
        path = tuple(dict.fromkeys([str(Path(python).parent), *self.path[1:]]))
        return JobEnvironment(python=python, pythonpath=self.pythonpath, path=path)

    def variables(self, account: Account) -> dict[str, str]:
        """The whole environment a job's processes start with, as `account`."""
        return {
            "PATH": ":".join(self.path),
            "HOME": account.home,
            "USER": account.name,
            "LOGNAME": account.name,
            "LANG": "C.UTF-8",
            "PYTHONPATH": ":".join(self.pythonpath),
            "PYTHONSAFEPATH": "1",  # neither the working directory nor a script's folder goes first
            "PYTHONNOUSERSITE": "1",  # no ~/.local packages: a shared account's home is shared
        }


def stage_worker(runtime_dir: Path) -> Path:
    """A folder holding only a copy of the `worker` package, named by its content; made once."""
    import worker

    source = Path(worker.__file__).resolve().parent
    files = sorted(path for path in source.rglob("*.py") if "__pycache__" not in path.parts)
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(source)).encode() + b"\0" + path.read_bytes() + b"\0")
    target = runtime_dir / f"worker-{digest.hexdigest()[:16]}"
    if (target / "worker").is_dir():
        return target
    runtime_dir.mkdir(parents=True, exist_ok=True)
    runtime_dir.chmod(RUNTIME_MODE)
    building = runtime_dir / f".building-{uuid.uuid4().hex}"
    for path in files:
        copy = building / "worker" / path.relative_to(source)
        copy.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, copy)
    # Jobs cannot write __pycache__ here, so compile now rather than on every rank's every start.
    compileall.compile_dir(building, quiet=2)
    for path in [building, *building.rglob("*")]:  # whatever the service's umask
        path.chmod(RUNTIME_MODE if path.is_dir() else 0o644)
    try:
        os.rename(building, target)
    except OSError:  # another replica staged the same content first
        shutil.rmtree(building, ignore_errors=True)
    return target
