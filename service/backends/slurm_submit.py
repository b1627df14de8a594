"""Submitting jobs that share their parameters and account: one sbatch, a job array when there are several.

Each array element's files land in its own job's `<job folder>/submitit` (the logs, the pickle whose
name tells the dispatcher the job's id after a restart), not in one shared folder. So the array's
submitit folder is `<array dir>/%a`, where `<array dir>/<index>` is a link to that job's folder: SLURM
expands %a in the log paths, and submitit's running side formats it from SLURM_ARRAY_TASK_ID, so every
element reads and writes inside its own job's folder.

The order keeps a dispatcher killed at any point recoverable (service.backends.slurm_recovery): the
pickles are staged, then the script is written, then sbatch runs; only once it answered do the
pickles get the names the running side waits for (it waits up to 60 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from service.backends.slurm_recovery import StagedPickle, script_name
from service.backends.slurm_request import request_for
from service.backends.submitit_adapter import pickled_call
from service.jobfs import remove_from, rename_in, write_new_file
from worker.launch import Supervisor
from worker.spec import RunSpec, ascii_int

log = logging.getLogger(__name__)

SbatchRunner = Callable[[Path], str]  # runs sbatch on a script, returns the job id or raises
_SCRIPT_MODE = 0o644  # sbatch reads the script as the job's account


def arrays_dir(data_dir: Path) -> Path:
    """Where the array folders (array_root) are made."""
    return data_dir / "slurm-arrays"


def array_job_ids(root: Path, jobs_root: Path) -> set[int]:
    """The ids of the jobs an array folder links to: its `<index>` links point into their folders."""
    ids: set[int] = set()
    for entry in os.scandir(root):
        if entry.is_symlink():
            target = Path(os.readlink(entry.path))
            if target.is_relative_to(jobs_root) and target != jobs_root:
                first = ascii_int(target.relative_to(jobs_root).parts[0])
                if first is not None:
                    ids.add(first)
    return ids


def array_root(arrays_dir: Path) -> Path:
    """A new `<arrays_dir>/<uuid>` for one job array; its folder template is `<root>/%a`.

    The service's own and readable by the jobs' accounts: sbatch reads the script in it as the job's
    account, and it is the array's working directory. `arrays_dir` itself lists for nobody."""
    arrays_dir = arrays_dir.resolve()
    if not arrays_dir.is_dir():
        arrays_dir.mkdir(parents=True, exist_ok=True)
        arrays_dir.chmod(0o711)
    root = arrays_dir / uuid.uuid4().hex
    root.mkdir()
    root.chmod(0o755)
    return root


def link_array_folders(root: Path, folders: Sequence[Path]) -> None:
    """`<root>/<index>` -> each job's submitit folder, so that `<root>/%a` is element %a's own folder.

    Plain strings, not Path objects: a sweep makes hundreds of links, and building paths cost more
    than the symlink calls."""
    prefix = f"{root}/"
    for index, folder in enumerate(folders):
        # Job folders come from the ledger already absolute and resolved: no lstat walk per job.
        target = folder if folder.is_absolute() else folder.resolve()
        os.symlink(target, f"{prefix}{index}", target_is_directory=True)


def submit_group(
    specs: Sequence[RunSpec],
    params: dict[str, Any],
    *,
    arrays_dir: Path,
    sbatch: SbatchRunner,
    python: str,
    srun: str,
    parallelism: int | None = None,
) -> list[str]:
    """Submit jobs that share `params` and an account in one sbatch (an array when there are several);
    their ids. `sbatch` runs with the job's built environment (it passes its own on, and srun the
    batch script's), in the folder the script lies in: the job's own, or for an array the array's
    folder, which only the service writes.

    An array's links are made on a helper thread while this one writes the pickles, and sbatch waits
    for them: both are file creations, whose cost is the kernel's, not the interpreter's, and in
    different folders. On a disk whose creates are slow, a sweep is accepted sooner (bench.sweep).
    """
    folders = [spec.files.submitit for spec in specs]
    if len(specs) == 1:
        return _submit(specs, params, folders, folders[0], folders[0], python, sbatch, srun)
    workdir = array_root(arrays_dir)
    with ThreadPoolExecutor(1, thread_name_prefix="torchyard-array-links") as helper:
        linking = helper.submit(link_array_folders, workdir, folders)

        def sbatch_once_linked(script: Path) -> str:
            linking.result()  # an element may start as soon as sbatch answers: its link must stand
            return sbatch(script)

        return _submit(
            specs, params, folders, workdir / "%a", workdir, python, sbatch_once_linked, srun, parallelism
        )


def _submit(
    specs: Sequence[RunSpec],
    params: dict[str, Any],
    folders: list[Path],
    template: Path,
    workdir: Path,
    python: str,
    sbatch: SbatchRunner,
    srun: str,
    parallelism: int | None = None,
) -> list[str]:
    """Stage each job's pickle in its own folder, write the script in `workdir`, run sbatch, then
    give the pickles their final names. Until sbatch answered, a failure leaves nothing behind."""
    token = uuid.uuid4().hex
    script = script_name(token)
    staged: list[StagedPickle] = []
    try:
        # Under temporary names inside each job's own folder (same filesystem: the rename is atomic).
        for index, (spec, folder) in enumerate(zip(specs, folders, strict=True)):
            staged.append(StagedPickle(folder, token, index))
            staged[-1].write(pickled_call(Supervisor(spec.model_dump_json()), int(params["time"])))
        request = request_for(
            specs, params, folder=template, workdir=workdir, python=python, parallelism=parallelism, srun=srun
        )
        write_new_file(workdir, script, request.materialize().encode(), _SCRIPT_MODE)
        job_id = sbatch(workdir / script)
    except BaseException:
        remove_from(workdir, script)
        for one in staged:
            one.discard()
        raise
    ids = [f"{job_id}_{index}" for index in range(len(specs))] if len(specs) > 1 else [job_id]
    # SLURM holds every element now: a failure from here on must not lose their ids (the dispatcher
    # would submit them again). An element whose folder its own account swapped meanwhile waits
    # for its pickle in vain and fails alone; the script's new name is submitit's habit only.
    for one, external_id in zip(staged, ids, strict=True):
        try:
            one.adopt(external_id)
        except OSError as error:
            log.warning("job %s cannot run: its pickle could not be named: %s", external_id, error)
    with contextlib.suppress(OSError):
        rename_in(workdir, script, f"{job_id}_submission.sh")
    return ids
