"""SLURM status, batched: one `squeue` for every active id, `sacct` only for the ids squeue forgot.

squeue answers for jobs that are queued, running or ended less than MinJobAge ago; an id it no longer
knows (ended while the service was down) is asked of sacct. After squeue fails, or takes longer than
SLOW_CALL_S, poll raises BackendError at once, without a call, until the controller backoff (2 s,
doubling to 60 s; a slow call holds off for as long as it took) has passed. Raising rather than
returning {} keeps the reconciler from reading silence as "the scheduler forgot these jobs". A failing
sacct (accounting down) only leaves those ids out, under a backoff of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import replace

from service.backends import slurm_parse as parse
from service.backends.base import BackendStatus
from service.backends.slurm_commands import SchedulerCommands
from service.backends.slurm_states import UnknownSlurmState
from service.errors import BackendError
from service.jobfs import is_external_id

log = logging.getLogger(__name__)

# ids per squeue/sacct/scancel call: a thousand active jobs still cost ONE squeue per interval, and
# 5000 ids (about 60 KB of arguments) stay far below ARG_MAX.
POLL_CHUNK = 5000


def job_ids(external_ids: Sequence[str]) -> list[str]:
    """The ids to ask about, each once; anything that is not an id's shape is left out (and said)."""
    wanted = list(dict.fromkeys(str(one) for one in external_ids))
    ids = [one for one in wanted if is_external_id(one)]
    if len(ids) < len(wanted):
        log.warning("left out %d value(s) that are no SLURM job id: %r", len(wanted) - len(ids),
                    [one for one in wanted if not is_external_id(one)][:5])  # fmt: skip
    return ids


def chunks(items: Sequence[str], size: int = POLL_CHUNK) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start : start + size])


def poll(commands: SchedulerCommands, external_ids: Sequence[str]) -> dict[str, BackendStatus]:
    """The status of each of these jobs that SLURM still knows (see the module's docstring)."""
    wanted = job_ids(external_ids)
    if not wanted:
        return {}
    waiting = commands.controller.remaining()
    if waiting > 0:
        last = commands.controller.last_error
        raise BackendError(f"not asking SLURM for {waiting:.0f} s more, after: {last}")
    records: dict[str, parse.SchedulerRecord] = {}
    for chunk in chunks(wanted):
        records.update(_squeue(commands, chunk))
    missing = [one for one in wanted if one not in records]
    if missing and commands.accounting.remaining() == 0:
        try:
            records.update(_sacct(commands, missing))
        except BackendError as error:
            log.warning("sacct failed, %d job(s) left for the next poll: %s", len(missing), error)
    return _statuses(wanted, records)


def every_submission(commands: SchedulerCommands) -> list[parse.Submission]:
    """Every job SLURM still shows, each array element on its own, with its script's path."""
    argv = [commands.program("squeue"), "-h", "-t", "all", "-r", "-O", parse.SUBMISSIONS_FORMAT]
    return parse.parse_submissions(commands.query(argv, commands.controller).stdout)


def _squeue(commands: SchedulerCommands, ids: list[str]) -> dict[str, parse.SchedulerRecord]:
    # `--jobs=<ids>` in one word: squeue's list is optional, so a separate word could be an option.
    squeue = commands.program("squeue")
    argv = [squeue, "-h", "-t", "all", "-r", "-O", parse.SQUEUE_FORMAT, f"--jobs={','.join(ids)}"]
    result = commands.query(argv, commands.controller)
    return parse.parse_squeue(result.stdout) if result.returncode == 0 else {}


def _sacct(commands: SchedulerCommands, ids: list[str]) -> dict[str, parse.SchedulerRecord]:
    # An array whose elements never started is one row "35_[0-3]": ask for the array's own id.
    queried = list(dict.fromkeys(one.split("_", 1)[0] for one in ids))
    records: dict[str, parse.SchedulerRecord] = {}
    for chunk in chunks(queried):
        jobs = f"--jobs={','.join(chunk)}"
        argv = [commands.program("sacct"), "-n", "-P", "-X", "-o", parse.SACCT_FORMAT, jobs]
        found = parse.parse_sacct(commands.query(argv, commands.accounting).stdout)
        records.update((one, replace(record, left_queue=True)) for one, record in found.items())
    # An array cancelled before any element left the queue can be one row under the array's
    # bare id ("62530", not "62530_[0-99]"), and squeue then lists none of its elements: that row
    # is the word for every element it still held. Without it they would wait here forever.
    for one in ids:
        base, _, index = one.partition("_")
        if index and one not in records and base in records:
            records[one] = records[base]
    return records


def _statuses(wanted: list[str], records: dict[str, parse.SchedulerRecord]) -> dict[str, BackendStatus]:
    statuses: dict[str, BackendStatus] = {}
    for one in wanted:
        record = records.get(one)
        if record is None:
            continue
        try:
            statuses[one] = parse.to_status(record)
        except UnknownSlurmState as error:
            log.warning("job %s: %s; leaving it as it was", one, error)
    return statuses
