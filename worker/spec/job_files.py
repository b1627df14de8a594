"""The names of the files in a job's folder, known to both sides (JobFiles), and the environment
variables that tell a rank where its folder is."""

from __future__ import annotations

import re
from collections.abc import Container
from pathlib import Path

CHECKPOINT_PATTERN = re.compile(r"^ckpt-(\d+)\.pt$")  # checkpoints/ckpt-<epoch or step, 8 digits>.pt
CHECKPOINT_NOTE_SUFFIX = ".json"  # ckpt-<n>.json beside ckpt-<n>.pt: the metrics reported when it was saved
JOB_DIR_ENV = "TORCHYARD_JOB_DIR"  # every rank's: its job's folder, where a job writes what it keeps
CHECKPOINT_DIR_ENV = "TORCHYARD_CHECKPOINT_DIR"  # every rank's: where checkpoints go (JobFiles.checkpoints)
# Every rank's, for scripts and experiment trackers (worker.runner sets them):
JOB_ID_ENV = "TORCHYARD_JOB_ID"  # the service's id of the job
RUN_ID_ENV = "TORCHYARD_RUN_ID"  # the same over the job's retries and requeues (RunSpec.run_id)
ATTEMPT_ENV = "TORCHYARD_ATTEMPT"  # 1 for the first attempt
UPSTREAM_ENV = "TORCHYARD_UPSTREAM"  # JobFiles.upstream: what the jobs it ran after left
# The SLURM batch script's, for the job's supervisor (worker.run_slurm): srun's absolute path (the job's
# PATH is the job's), and the per-rank log templates (`%t`: the task) its steps get as --output/--error.
SRUN_ENV = "TORCHYARD_SRUN"
RANK_OUTPUT_ENV = "TORCHYARD_RANK_OUTPUT"
RANK_ERROR_ENV = "TORCHYARD_RANK_ERROR"


def checkpoint_note_name(checkpoint: str) -> str:
    """ckpt-<n>.pt -> ckpt-<n>.json: the note rank 0 writes once the checkpoint's file is whole."""
    return checkpoint.removesuffix(".pt") + CHECKPOINT_NOTE_SUFFIX


def checkpoint_is_whole(checkpoint: str, names: Container[str]) -> bool:
    """The one rule, for the worker and the service alike, of which checkpoints are listed and resumed
    from: those whose note is among the folder's `names`. Rank 0 writes the note after the file is
    whole (fsync-ed and renamed; worker.checkpoints), so a rank killed mid-write, before the rename
    or between it and the note, leaves nothing that counts."""
    return checkpoint_note_name(checkpoint) in names


class JobFiles:
    """Names of the files inside a job's folder, known to both sides."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @property
    def spec(self) -> Path:
        """The RunSpec of the attempt that last started, written by its rank 0 (for people to read)."""
        return self.folder / "spec.json"

    @property
    def upstream(self) -> Path:
        """Written by rank 0 before the others connect: the jobs this one ran after (RunSpec.upstream),
        as a JSON list, for scripts (functions get ctx.upstream)."""
        return self.folder / "upstream.json"

    @property
    def progress(self) -> Path:
        """JSON lines appended by rank 0: {"step", "total", "metrics", "time", "attempt"}."""
        return self.folder / "progress.jsonl"

    @property
    def result(self) -> Path:
        """Written atomically by rank 0 on success: {"attempt", "value"}."""
        return self.folder / "result.json"

    def error(self, rank: int) -> Path:
        """Written atomically by a rank that raised: a first line `attempt: <n>`, then its traceback.

        A rank removes its own when it starts, but a reader may still find one an earlier attempt
        left behind: parse_error_text() says which attempt wrote it.
        """
        return self.folder / f"error-rank{rank}.txt"

    def placement(self, rank: int) -> Path:
        """Written atomically by every rank when it starts: {"attempt", "rank", "host", "local_rank",
        "gpu", "pid"} (parse_placement), so the service knows where each rank of the attempt runs."""
        return self.folder / "placement" / f"rank{rank}.json"

    @property
    def restarts(self) -> Path:
        """JSON lines appended by the job's supervisor (worker.supervisor), one per restart in place
        and one when it gives up: {"attempt", "restart", "outcome", "cause", ...} (parse_restart_line)."""
        return self.folder / "restarts.jsonl"

    @property
    def restart_request(self) -> Path:
        """Written atomically by the service (its watchdog, for a hung attempt): {"attempt", "run",
        "cause", "detail"} (parse_restart_request); the supervisor restarts that run in place."""
        return self.folder / "restart-request.json"

    def rendezvous(self, key: str) -> Path:
        """Written atomically by rank 0 before the others connect: {"addr", "port", "host", "pid"}.

        `key` names one run of the ranks (worker.rendezvous.rendezvous_key), so a retried or requeued
        job never reads an earlier run's port.
        """
        return self.folder / "rendezvous" / f"{key}.json"

    def stacks(self, rank: int) -> Path:
        """Appended to by the rank's faulthandler on every SIGURG (worker.stacks): the text of every
        thread's Python stack ("Thread 0x... (most recent call first):" blocks). A reader notes its
        size before signalling and reads only what was appended after."""
        return self.folder / "stacks" / f"rank{rank}.txt"

    def activity(self, rank: int) -> Path:
        """Rewritten atomically by a thread of every rank each ACTIVITY_INTERVAL_S: {"attempt", "rank",
        "host", "pid", "time", "changed_at", "where"} (parse_activity). A rank whose Python cannot run
        (C code holding the GIL) stops rewriting it: its `time` goes stale."""
        return self.folder / "activity" / f"rank{rank}.json"

    @property
    def flight_recorder_prefix(self) -> Path:
        """TORCH_NCCL_DEBUG_INFO_TEMP_FILE of an NCCL job's ranks: PyTorch appends the rank number."""
        return self.folder / "stacks" / "nccl-rank"

    def flight_recorder(self, rank: int) -> Path:
        """The NCCL flight recorder's dump of `rank` (PyTorch's pickle of plain containers), written by
        PyTorch on a collective's timeout or on request."""
        return self.flight_recorder_prefix.with_name(f"{self.flight_recorder_prefix.name}{rank}")

    @property
    def code(self) -> Path:
        """The job's code snapshot, unpacked read-only by the service: the ranks' working directory."""
        return self.folder / "code"

    @property
    def checkpoints(self) -> Path:
        return self.folder / "checkpoints"

    @property
    def tmp(self) -> Path:
        """The ranks' TMPDIR: temporary files stay inside the job's own folder."""
        return self.folder / "tmp"

    @property
    def submitit(self) -> Path:
        """submitit's own folder: pickles and per-rank logs (`<id>_<rank>_log.out|err`)."""
        return self.folder / "submitit"

    def rank_log(self, external_id: str, rank: int, stream: str = "out") -> Path:
        """Rank `rank`'s stdout (`out`) or stderr (`err`) in the run `external_id` (the scheduler's id:
        a SLURM job, `<array>_<index>`, a local controller's PID): submitit's names, which the
        supervisor keeps for the ranks it starts. The supervisor's own lines go to rank 0's."""
        return self.submitit / f"{external_id}_{rank}_log.{stream}"

    def checkpoint_file(self, epoch_or_step: int) -> Path:
        """Where rank 0 saves the checkpoint of this epoch or step (zero-padded, so names sort)."""
        return self.checkpoints / f"ckpt-{epoch_or_step:08d}.pt"

    def checkpoint_note(self, checkpoint: Path) -> Path:
        """The note beside a checkpoint: {"step", "metrics", "time", "attempt"} (parse_checkpoint_note)."""
        return checkpoint.with_name(checkpoint_note_name(checkpoint.name))

    def saved_checkpoints(self) -> list[tuple[int, Path]]:
        """(epoch or step, path) of every whole checkpoint in checkpoints/, oldest first: those with
        their note beside them (checkpoint_is_whole); temp files and half-written ones ignored."""
        if not self.checkpoints.is_dir():
            return []
        names = {path.name for path in self.checkpoints.iterdir()}
        return sorted(
            (int(match.group(1)), self.checkpoints / name)
            for name in names
            if (match := CHECKPOINT_PATTERN.fullmatch(name)) and checkpoint_is_whole(name, names)
        )

    def latest_checkpoint(self) -> Path | None:
        """The whole checkpoint with the highest epoch or step in checkpoints/, or None: what a restart
        resumes from."""
        saved = self.saved_checkpoints()
        return saved[-1][1] if saved else None
