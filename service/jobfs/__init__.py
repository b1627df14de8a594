"""The job folder's one door: the only code that opens, names, writes, renames or removes below a job's
folder. One security surface to review, one place to add a file.

A job is untrusted code, and its account owns its folder: whatever the service (root in production)
finds there may be a link planted to make it read, write or remove something of another account's,
a FIFO to hang a thread, or more names and bytes than any reader should take. So:
- handles.py: every folder and file is opened by a handle that follows no link (the one module that
  spells the open flags), every step below the job's folder is taken from such a handle, and every
  file the service makes is new;
- names.py: the names that worker.spec.JobFiles (the contract with the worker) does not spell:
  submitit's logs and pickles, the service's `attempts/` and trash;
- reads.py: what the service reads (result, error files, placement, progress, logs, the id submitit
  gave a job), bounded and cleaned before it nears the ledger;
- stacks.py: the ranks' stacks files (read after a noted size), activity files and NCCL flight
  recorder dumps, bounded;
- checkpoints.py: a bounded page of rank 0's checkpoints, and one opened for download;
- writes.py: the job folder made, an attempt's files moved aside, the backends' pickles and scripts,
  the link to the job's code snapshot's shared copy;
- folders.py: a whole folder measured, and removed through the trash;
- restarts.py: the supervisor's restarts.jsonl read, the service's restart-request.json written.
"""

from service.jobfs.checkpoints import (
    CheckpointFile,
    Key,
    checkpoint_key,
    open_checkpoint_file,
    scan_checkpoints,
)
from service.jobfs.folders import FolderUsage, empty_trash, move_files_to_trash, move_folder_to_trash, usage
from service.jobfs.handles import folder_handle, new_file
from service.jobfs.names import (
    LOG_NAME,
    SUBMITTED_SUFFIX,
    TRASH,
    is_external_id,
    job_folder,
    jobs_root,
    log_file,
    log_name,
)
from service.jobfs.reads import (
    NotAFile,
    RankError,
    error_ranks,
    log_tail,
    open_log,
    rank_errors,
    read_new_progress,
    read_placement,
    read_result,
    result_written,
    submitted_external_id,
)
from service.jobfs.restarts import read_new_restarts, read_restart_request, write_restart_request
from service.jobfs.stacks import (
    StackText,
    read_activity,
    read_flight_records,
    read_stack_texts,
    read_stacks_after,
    stack_sizes,
)
from service.jobfs.writes import (
    archive_attempt,
    link_code,
    make_job_folder,
    names_in,
    remove_from,
    rename_in,
    write_new_file,
)

__all__ = [
    "LOG_NAME",
    "SUBMITTED_SUFFIX",
    "TRASH",
    "CheckpointFile",
    "FolderUsage",
    "Key",
    "NotAFile",
    "RankError",
    "StackText",
    "archive_attempt",
    "checkpoint_key",
    "empty_trash",
    "error_ranks",
    "folder_handle",
    "is_external_id",
    "job_folder",
    "jobs_root",
    "link_code",
    "log_file",
    "log_name",
    "log_tail",
    "make_job_folder",
    "move_files_to_trash",
    "move_folder_to_trash",
    "names_in",
    "new_file",
    "open_checkpoint_file",
    "open_log",
    "rank_errors",
    "read_activity",
    "read_flight_records",
    "read_new_progress",
    "read_new_restarts",
    "read_placement",
    "read_restart_request",
    "read_result",
    "read_stack_texts",
    "read_stacks_after",
    "remove_from",
    "rename_in",
    "result_written",
    "scan_checkpoints",
    "stack_sizes",
    "submitted_external_id",
    "usage",
    "write_new_file",
    "write_restart_request",
]
