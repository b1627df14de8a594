"""Reading what squeue, sacct, sbatch and scontrol print. Pure functions over text, tested on real output
recorded from the test cluster (tests/data/slurm/).

Why two status commands: squeue answers from slurmctld's memory, so it knows every queued and running
job at once, and ended jobs for MinJobAge (300 s by default) with their raw exit status. sacct answers
from the accounting database, which learns of a pending job late (not before it is eligible and the
controller has sent it over), but keeps ended jobs forever. The backend asks squeue first and sacct only
for what squeue no longer knows.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from datetime import datetime, timezone

from service.backends.base import BackendStatus
from service.backends.slurm_states import map_slurm_state, slurm_kind
from service.states import JobState, is_terminal
from worker.hostlist import expand_hostlist
from worker.spec import ascii_int

# squeue -O "name:|": no width means no padding and no truncation, and "|" follows the field.
# StartTime: for a pending job, the scheduler's own estimate of its start (its backfill pass), taken
# in the same call as the states. It came later: recordings made before it have six fields.
# BatchHost: where the batch script runs, which stays named after SLURM removed that node from a
# --no-kill allocation and ended it (NodeList then lacks it). Later still: older recordings have seven.
SQUEUE_FIELDS = ("JobArrayID", "State", "Reason", "exit_code", "RestartCnt", "NodeList", "StartTime",
                 "BatchHost")  # fmt: skip
SQUEUE_MIN_FIELDS = 6
SQUEUE_FORMAT = ",".join(f"{name}:|" for name in SQUEUE_FIELDS[:-1]) + f",{SQUEUE_FIELDS[-1]}:"
# Which script each job was submitted with: how a submission whose sbatch never answered is found again.
SUBMISSIONS_FORMAT = "JobArrayID:|,State:|,Command:"
SACCT_FIELDS = ("JobID", "State", "ExitCode", "Reason", "NodeList")
SACCT_FORMAT = ",".join(SACCT_FIELDS)

_ARRAY_RANGE = re.compile(r"^(?P<base>\d+)_\[(?P<ranges>[0-9,\-]+)(%\d+)?\]$")
_NO_NODES = {"", "None assigned", "(null)", "None", "n/a", "N/A"}  # "n/a": a pending job's BatchHost
_WAITING = {JobState.pending, JobState.requeued, JobState.preempted}


@dataclass(frozen=True)
class SchedulerRecord:
    """One job as the scheduler printed it, before mapping."""

    state: str  # SLURM's word, e.g. "RUNNING", "CANCELLED by 0"
    reason: str | None = None  # the scheduler's reason ("Resources", "Priority"); None for "None"
    exit_code: int | None = None
    signal: int | None = None
    restarts: int = 0  # times SLURM requeued the job (squeue only)
    nodes: str | None = None  # SLURM's compact host list, e.g. "n[1-2]"
    left_queue: bool = False  # from accounting: squeue no longer lists the job
    start: datetime | None = None  # squeue's StartTime: the expected start while the job waits
    # Where the batch script ran: squeue's BatchHost, or from sacct the first node of the allocation as
    # it started (its first row: a --no-kill job that lost a node has a RESIZING row before the last).
    batch_host: str | None = None

    @property
    def lost_batch_host(self) -> str | None:
        """The batch host, when the allocation no longer holds it: SLURM removed it (lost) and ended
        the job with it (a --no-kill job: state FAILED, signal 9, squeue's reason JobLaunchFailure)."""
        if not self.batch_host or not self.nodes:
            return None
        try:
            return None if self.batch_host in expand_hostlist(self.nodes) else self.batch_host
        except ValueError:
            return None


def expand_job_ids(job_id: str) -> list[str]:
    """One id as printed -> the ids it stands for: "7" -> ["7"], "35_[0-2,5%4]" -> ["35_0", ..., "35_5"]."""
    match = _ARRAY_RANGE.match(job_id)
    if match is None:
        return [job_id]
    ids: list[str] = []
    for part in match["ranges"].split(","):
        low, _, high = part.partition("-")
        ids.extend(f"{match['base']}_{index}" for index in range(int(low), int(high or low) + 1))
    return ids


def _reason(value: str) -> str | None:
    value = value.strip()
    return None if value in ("", "None", "(null)") else value


def _nodes(value: str) -> str | None:
    value = value.strip()
    return None if value in _NO_NODES else value


def _start_time(value: str) -> datetime | None:
    """squeue's StartTime ("2026-12-04T18:45:07", in the local time of the host that ran squeue: this
    one) in UTC; None for "N/A", "Unknown" and "None"."""
    try:
        return datetime.fromisoformat(value.strip()).astimezone(timezone.utc)
    except ValueError:
        return None


def parse_squeue(text: str) -> dict[str, SchedulerRecord]:
    """Rows of `squeue -h -t all -r -O SQUEUE_FORMAT`; exit_code there is the raw wait status."""
    records: dict[str, SchedulerRecord] = {}
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < SQUEUE_MIN_FIELDS:
            continue
        job_id, state, reason, raw_exit, restarts, nodes = (field.strip() for field in fields[:6])
        start = _start_time(fields[6]) if len(fields) > 6 else None
        batch_host = _nodes(fields[7]) if len(fields) > 7 else None
        status = ascii_int(raw_exit) or 0
        record = SchedulerRecord(
            state=state,
            reason=_reason(reason),
            exit_code=(status >> 8) & 0xFF,
            signal=(status & 0x7F) or None,
            restarts=ascii_int(restarts) or 0,
            nodes=_nodes(nodes),
            start=start,
            batch_host=batch_host,
        )
        for one in expand_job_ids(job_id):  # only a pending array without -r prints a range
            records[one] = record
    return records


@dataclass(frozen=True)
class Submission:
    """One row of `squeue -h -r -t all -O SUBMISSIONS_FORMAT`."""

    job_id: str  # "7", or "35_2" for an array element
    state: str
    command: str  # the script path as given to sbatch; "(null)" for --wrap

    @property
    def array_index(self) -> int:
        _, _, index = self.job_id.partition("_")
        return ascii_int(index) or 0


def parse_submissions(text: str) -> list[Submission]:
    rows: list[Submission] = []
    for line in text.splitlines():
        job_id, _, rest = line.partition("|")
        state, _, command = rest.partition("|")
        if job_id.strip() and command:
            rows.append(Submission(job_id.strip(), state.strip(), command.strip()))
    return rows


def parse_sacct(text: str) -> dict[str, SchedulerRecord]:
    """Rows of `sacct -n -P -X -o SACCT_FORMAT`; ExitCode there is "code:signal". A job that lost a
    node under --no-kill has several rows (RESIZING, with the nodes it had, then its last word): the
    last row is its state, the first names its batch host (the first node it started with)."""
    records: dict[str, SchedulerRecord] = {}
    first_nodes: dict[str, str | None] = {}
    for line in text.splitlines():
        fields = line.split("|")
        if len(fields) < len(SACCT_FIELDS) or "." in fields[0]:  # a step, not a job
            continue
        job_id, state, exit_pair, reason, nodes = (field.strip() for field in fields[:5])
        code, _, sig = exit_pair.partition(":")
        started_on = first_nodes.setdefault(job_id, _nodes(nodes))
        record = SchedulerRecord(
            state=state,
            reason=_reason(reason),
            exit_code=ascii_int(code),
            signal=ascii_int(sig) or None,
            nodes=_nodes(nodes),
            batch_host=_first_host(started_on),
        )
        for one in expand_job_ids(job_id):  # a pending or cancelled-while-pending array: "35_[0-3]"
            records[one] = record
    return records


def _first_host(nodes: str | None) -> str | None:
    try:
        hosts = expand_hostlist(nodes or "")
    except ValueError:
        return None
    return hosts[0] if hosts else None


def _signal_text(number: int) -> str:
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def to_status(record: SchedulerRecord) -> BackendStatus:
    """Our view of one record. Raises UnknownSlurmState for a word the table does not know."""
    state, state_reason = map_slurm_state(record.state)
    if state is JobState.preempted and record.left_queue:
        # Preempted and gone from the queue: SLURM cancelled it (PreemptMode=CANCEL, or a job that may
        # not be requeued). It will not come back by itself: an ending, of the kind `preemption`.
        state, state_reason = JobState.failed, "preempted, not requeued"
    if state is JobState.pending and record.restarts > 0:
        # Back in the queue after a requeue (preemption, node failure, submitit's checkpoint): squeue
        # shows PENDING again, and only the restart count tells it apart from a first wait.
        state, state_reason = JobState.requeued, f"requeued (restart {record.restarts})"
    waiting = state in _WAITING
    parts = [state_reason]
    if waiting:
        parts.append(record.reason)  # why it waits: Resources, Priority, JobHeldUser, BeginTime ...
    terminal = is_terminal(state)
    lost = record.lost_batch_host if terminal else None
    if lost:
        # SLURM removed the batch host from the allocation and ended it (FAILED, signal 9; never
        # requeued by SLURM): nothing inside the allocation survives to restart the ranks.
        state, parts = JobState.failed, [f"node {lost}, the batch host, was lost: SLURM ends the allocation "
                                         "with it, so no restart in place could follow"]  # fmt: skip
    if terminal and record.signal:
        parts.append(_signal_text(record.signal))
    reason = "; ".join(part for part in parts if part) or None
    return BackendStatus(
        state=state,
        reason=reason,
        exit_code=record.exit_code if terminal else None,
        nodes=record.nodes,
        kind="node_failure" if lost else slurm_kind(record.state) if terminal else None,
        expected_start=record.start if waiting else None,
        lost_batch_host=lost,
    )


# ---------------------------------------------------------------- sbatch and scontrol

_TRANSIENT = (
    "unable to contact slurm controller",
    "socket timed out",
    "temporarily unable",
    "connection refused",
    "connection timed out",
    "zero bytes were transmitted",
    "not responding",
    "communication connection failure",
    "slurm_persist_conn_open",
    "slurmctld is down",
)
_PREFIXES = ("sbatch: error: ", "batch job submission failed: ", "allocation failure: ", "sbatch: ")


def parse_sbatch_job_id(stdout: str) -> str | None:
    """`sbatch --parsable` prints "<id>" or "<id>;<cluster>"; plain sbatch "Submitted batch job <id>"."""
    match = re.search(r"^(?:Submitted batch job )?([0-9]+)(?:;\S+)?\s*$", stdout.strip(), re.MULTILINE)
    return match.group(1) if match else None


def sbatch_error(stderr: str) -> str:
    """SLURM's own words from sbatch's stderr, without the prefixes, one clause per distinct line."""
    clauses: list[str] = []
    for line in stderr.splitlines():
        text = line.strip()
        changed = True
        while changed:
            changed = False
            for prefix in _PREFIXES:
                if text.lower().startswith(prefix):
                    text, changed = text[len(prefix) :].strip(), True
        if text and text not in clauses:
            clauses.append(text)
    return "; ".join(clauses) or "sbatch failed without saying why"


def is_transient(message: str) -> bool:
    """True for "the scheduler could not be reached", as opposed to "the scheduler says no"."""
    lowered = message.lower()
    return any(needle in lowered for needle in _TRANSIENT)


def parse_config_value(config_text: str, key: str) -> str | None:
    """One value of `scontrol show config` ("MaxArraySize            = 1001")."""
    match = re.search(rf"^{re.escape(key)}\s*=\s*(\S+)", config_text, re.MULTILINE)
    return match.group(1) if match else None


# First match wins: "Invalid account or account/partition combination" is about the account.
_FIELDS_BY_WORDS = (
    (("account",), "resources.account"),
    (("qos",), "resources.qos"),
    (("feature", "constraint"), "resources.constraint"),
    (("node count", "nodes"), "resources.nodes"),
    (("partition",), "resources.partition"),
    (("time limit",), "resources.timeout_min"),
    (("memory", "mem"), "resources.mem_gb"),
    (("gres", "gpu", "generic resource"), "resources.gpus_per_node"),
)


def error_field(message: str, cpus_per_task: int = 1) -> str:
    """The request field SLURM's refusal is about, for InvalidRequest(field=...)."""
    lowered = message.lower()
    for words, field in _FIELDS_BY_WORDS:
        if any(word in lowered for word in words):
            return field
    if "processors" in lowered or "cpu" in lowered:
        return "resources.cpus_per_task" if cpus_per_task > 1 else "resources.tasks_per_node"
    return "resources"
