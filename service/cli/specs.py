"""Job and sweep spec files (YAML or JSON) read for `submit` and `sweep`, and the code folders they
name packed and uploaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from rich.progress import Progress

from service.cli.context import EXIT_REQUEST, fail, make_console
from service.client import TorchyardClient
from worker.spec import CODE_ID_PREFIX


def load_spec(
    path: Path, code: Path | None = None, what: str = "name, entrypoint or script, ..."
) -> dict[str, Any]:
    """A job spec (or a sweep's, whose `job` is one) from YAML or JSON. A `code` that is not a
    snapshot id is a folder, taken relative to the spec file's folder (`code: .` is the spec's own),
    which `submit` packs and uploads; a relative `script` is then a file of that code. Without code, a
    relative `script` is taken relative to the spec file's folder, so a spec next to its script works
    from any directory (the service needs an absolute path). `code` (submit --code) replaces the
    spec's own."""
    try:
        text = path.read_text()
        spec = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as error:
        raise fail(f"cannot read {path}: {error}", EXIT_REQUEST) from None
    if not isinstance(spec, dict):
        raise fail(f"{path} must hold one mapping ({what})", EXIT_REQUEST)
    if code is not None:
        spec["code"] = str(code.resolve())
    for job in _job_specs(spec):
        if not isinstance(job, dict):
            continue
        code_field, script = job.get("code"), job.get("script")
        if isinstance(code_field, str) and not code_field.startswith(CODE_ID_PREFIX):
            job["code"] = str((path.parent / code_field).resolve())
        elif code_field is None and isinstance(script, str) and script and not Path(script).is_absolute():
            job["script"] = str((path.parent / script).resolve())
    return spec


def _job_specs(spec: dict[str, Any]) -> list[Any]:
    """The job specs in a spec file: itself, a sweep's job, a pipeline's stages' jobs and sweeps'."""
    found: list[Any] = [spec, spec.get("job")]
    stages = spec.get("stages")
    for stage in stages if isinstance(stages, list) else []:
        if isinstance(stage, dict):
            sweep = stage.get("sweep")
            found += [stage.get("job"), sweep.get("job") if isinstance(sweep, dict) else None]
    return found


PROGRESS_FROM_BYTES = 4 * 2**20  # smaller uploads take a moment: no bar


def upload_code(client: TorchyardClient, folder: Path) -> str:
    """Pack and upload `folder` (only when the service lacks it), with a progress bar when it is large."""
    if not folder.is_dir():
        raise fail(f"code: {folder} is not a folder", EXIT_REQUEST)
    with Progress(transient=True, console=make_console(stderr=True)) as bar:
        task = bar.add_task(f"uploading {folder.name or folder}", total=None, visible=False)

        def advance(sent: int, total: int) -> None:
            bar.update(task, completed=sent, total=total, visible=total >= PROGRESS_FROM_BYTES)

        code_id = client.upload_code(folder, progress=advance)
    make_console(stderr=True).print(f"code {folder} is {code_id}", soft_wrap=True, markup=False)
    return code_id


def upload_code_folder(client: TorchyardClient, job: dict[str, Any]) -> None:
    """A job spec's `code` that names a folder (load_spec made it absolute): packed, uploaded unless
    the service has it, and replaced by its id."""
    if isinstance(job.get("code"), str) and not job["code"].startswith(CODE_ID_PREFIX):
        job["code"] = upload_code(client, Path(job["code"]))
