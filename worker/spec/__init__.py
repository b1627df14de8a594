"""The contract between the service and the worker: plain pydantic, no torch, no service imports.

The service builds a RunSpec for every job attempt and hands it (as JSON) to submitit; every rank
receives the same RunSpec. Files the two sides exchange live in the job's folder (see JobFiles).

This package is the contract's one door: import its names from `worker.spec` (the service imports
nothing else of the worker but `worker.launch`). Its modules, one concept each:
- run_spec.py: RunSpec and what it asks for (Resources, CheckpointPolicy, ArrayGroup, the entrypoint
  and code snapshot id checks);
- job_files.py: JobFiles, the names of the files in a job's folder, and the rank's folder variables;
- records.py: what the ranks write there and the one parser of each (progress lines, placement files,
  error files' attempt line, checkpoint notes, activity files), with the metric limits;
- cleaning.py: text and numbers a job wrote made fit for every reader (clean_text, storable,
  json_problem, ascii_int).

Pickles do not name these modules: the service pickles a worker.launch.RankLauncher, which keeps
only the RunSpec's JSON text.
"""

from worker.spec.cleaning import MAX_DIGITS, MAX_JSON_DEPTH, ascii_int, clean_text, json_problem, storable
from worker.spec.job_files import (
    ATTEMPT_ENV,
    CHECKPOINT_DIR_ENV,
    CHECKPOINT_NOTE_SUFFIX,
    CHECKPOINT_PATTERN,
    JOB_DIR_ENV,
    JOB_ID_ENV,
    RUN_ID_ENV,
    UPSTREAM_ENV,
    JobFiles,
)
from worker.spec.records import (
    ACTIVITY_INTERVAL_S,
    ERROR_ATTEMPT_PREFIX,
    MAX_COUNT,
    MAX_HOST_CHARS,
    MAX_METRIC_NAME_CHARS,
    MAX_METRIC_NAMES,
    MAX_METRICS_PER_LINE,
    MAX_PATH_CHARS,
    MAX_WHERE_CHARS,
    PROGRESS_KEYS,
    PROTECTED_HARDLINKS,
    CheckpointRecord,
    ProgressRecord,
    RankActivity,
    RankPlacement,
    metrics_problem,
    node_hardlinks_protected,
    parse_activity,
    parse_checkpoint_note,
    parse_error_text,
    parse_placement,
    parse_progress_line,
)
from worker.spec.run_spec import (
    CODE_ID_PATTERN,
    CODE_ID_PREFIX,
    ENTRYPOINT_PATTERN,
    SLURM_CONSTRAINT_PATTERN,
    SLURM_NAME_PATTERN,
    ArrayGroup,
    CheckpointPolicy,
    KeepBest,
    Resources,
    RunSpec,
    UpstreamJob,
    Watchdog,
    check_entrypoint,
    check_one_target,
    tracker_run_id,
)

__all__ = [
    "ACTIVITY_INTERVAL_S",
    "ATTEMPT_ENV",
    "CHECKPOINT_DIR_ENV",
    "CHECKPOINT_NOTE_SUFFIX",
    "CHECKPOINT_PATTERN",
    "CODE_ID_PATTERN",
    "CODE_ID_PREFIX",
    "ENTRYPOINT_PATTERN",
    "ERROR_ATTEMPT_PREFIX",
    "JOB_DIR_ENV",
    "JOB_ID_ENV",
    "MAX_COUNT",
    "MAX_DIGITS",
    "MAX_HOST_CHARS",
    "MAX_JSON_DEPTH",
    "MAX_METRICS_PER_LINE",
    "MAX_METRIC_NAMES",
    "MAX_METRIC_NAME_CHARS",
    "MAX_PATH_CHARS",
    "MAX_WHERE_CHARS",
    "PROGRESS_KEYS",
    "PROTECTED_HARDLINKS",
    "RUN_ID_ENV",
    "SLURM_CONSTRAINT_PATTERN",
    "SLURM_NAME_PATTERN",
    "UPSTREAM_ENV",
    "ArrayGroup",
    "CheckpointPolicy",
    "CheckpointRecord",
    "JobFiles",
    "KeepBest",
    "ProgressRecord",
    "RankActivity",
    "RankPlacement",
    "Resources",
    "RunSpec",
    "UpstreamJob",
    "Watchdog",
    "ascii_int",
    "check_entrypoint",
    "check_one_target",
    "clean_text",
    "json_problem",
    "metrics_problem",
    "node_hardlinks_protected",
    "parse_activity",
    "parse_checkpoint_note",
    "parse_error_text",
    "parse_placement",
    "parse_progress_line",
    "storable",
    "tracker_run_id",
]
