"""The names in a job's folder that the service reads or makes and the worker's JobFiles (the contract,
worker.spec) does not spell: submitit's, and the service's own. One place each, so that the
writer and every reader (retention's matcher of logs included) agree.
"""

from __future__ import annotations

import re
from pathlib import Path

from service.config import Settings
from worker.spec import JobFiles

# The data directory and its jobs folder: jobs of every account reach their own folder inside; nobody
# lists it.
DATA_DIR_MODE = 0o711
SUBMITIT = JobFiles(Path(".")).submitit.name  # submitit's folder in the job's
CODE = JobFiles(Path(".")).code.name  # the job's copy of its code snapshot
ATTEMPTS = "attempts"  # earlier attempts' submitit folders and error files (archive_attempt)
TRASH = ".trash"  # in the jobs folder: what retention removes goes here first
SUBMITTED_SUFFIX = "_submitted.pkl"  # submitit's `<external id>_submitted.pkl`, once a job is submitted
# Every external id: a SLURM job or array element (`<digits>` or `<digits>_<digits>`), a local PID.
# Ids are read back from names in job folders, which their jobs can change: only this shape is an id,
# so that no name ("--user=bob") can reach a scheduler's command line as an option.
EXTERNAL_ID = re.compile(r"[0-9]{1,18}(_[0-9]{1,9})?", re.ASCII)
LOG_NAME = re.compile(r"^.+_log\.(out|err)$")  # submitit's per-rank logs: what `keep_logs_days` keeps


def log_name(external_id: str, rank: int, stream: str = "out") -> str:
    """submitit's `<id>_<rank>_log.out|err`; an array element's id is `<array>_<index>`."""
    return JobFiles(Path(".")).rank_log(external_id, rank, stream).name


def log_file(folder: Path, external_id: str, rank: int, stream: str = "out") -> Path:
    """Where submitit writes rank `rank`'s log of the run `external_id` of the job in `folder`."""
    return JobFiles(folder).rank_log(external_id, rank, stream)


def submitted_name(external_id: str) -> str:
    return f"{external_id}{SUBMITTED_SUFFIX}"


def is_external_id(text: str) -> bool:
    return EXTERNAL_ID.fullmatch(text) is not None


def job_folder(settings: Settings, job_id: int) -> Path:
    """Where job `job_id`'s folder is."""
    return (settings.data_dir / "jobs" / str(job_id)).resolve()


def jobs_root(settings: Settings) -> Path:
    """The folder every job folder is made in."""
    return job_folder(settings, 0).parent
