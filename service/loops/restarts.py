"""Restarts in place into the ledger, and the watchdog's request for one.

The job's supervisor (worker.supervisor, the job's account, inside the allocation) restarts the ranks
of an attempt in place and appends a record to restarts.jsonl; the reconcile loop reads the new lines
of each job it looks at (`ingest_restarts`, in the job's own savepoint, after its progress), as it
reads progress: an offset kept on the job, a bounded read through service.jobfs, the worker's one
parser. Each new "restarted" record of the current attempt counts on the job, makes an event (and a
`job.restarted` webhook) and clears what the lost run left (its stall flag, its placement); a
"gave_up" record is kept for the attempt's ending (service.domain.restarts.with_give_up). Records of
another attempt, or read before, are skipped: the file is the job's to write.

A hung attempt (watchdog `on_stall: "fail"`) whose restart policy covers `hang` and has restarts left
is not ended: `request_restart` writes restart-request.json for its current run, once.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import func
from sqlmodel import Session, col, select

from service.domain import goodput, restarts
from service.domain.transitions import clear_stall, record_restart
from service.jobfs import read_new_restarts, read_restart_request, write_restart_request
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric
from worker.spec import JobFiles, RestartRecord, RestartRequest

log = logging.getLogger(__name__)


def ingest_restarts(session: Session, job: Job) -> bool:
    """Read the job's new restart records into the ledger. True when anything changed on it."""
    if job.folder is None:
        return False
    read = read_new_restarts(JobFiles(Path(job.folder)).restarts, job.restarts_offset)
    changed = False
    if read is not None:
        records, job.restarts_offset = read
        session.add(job)
        for record in records:
            changed = _one(session, job, record) or changed
    changed = _back_to_training(job) or changed
    if changed:
        goodput.refresh(session, job, utcnow())
    return changed


def _one(session: Session, job: Job, record: RestartRecord) -> bool:
    attempt = job.run_attempt or job.attempt
    if record.attempt != attempt:  # an earlier attempt's (read late), or not the supervisor's at all
        return False
    limit = restarts.policy_of(job.spec).max
    if record.outcome == restarts.GAVE_UP:
        if restarts.of_attempt(job.restart_log, attempt, restarts.GAVE_UP):
            return False
        kept = restarts.entry(record)
        kept["reason"] = restarts.describe_give_up(record, limit)
        job.restart_log = restarts.appended(job.restart_log, kept)
        record_restart(session, job, f"not restarted in place: {kept['reason']}", notify=False)
        return True
    if record.restart <= restarts.runs_seen(job.restart_log, attempt):
        return False  # read before (a line written twice): once each
    earlier = restarts.of_attempt(job.restart_log, attempt)
    run_start = earlier[-1].get("started_at") if earlier else None
    if run_start is None and job.attempt_started_at is not None:
        run_start = job.attempt_started_at.timestamp()
    saved = goodput.saved_at(job, record.resumed_from)
    if saved is None:
        saved = _checkpoint_time(session, job, attempt, record.resumed_step)
    kept = restarts.entry(record, run_start=run_start, checkpoint_at=saved)
    job.restart_log = restarts.appended(job.restart_log, kept)
    job.restart_count += 1
    job.placement = None  # the new run's ranks say where they are again (the lost node is left out)
    job.progress_at = utcnow()  # the watchdog gives the new run its time from its start
    clear_stall(session, job)
    record_restart(session, job, restarts.describe(record, limit), notify=True)
    log.info("job %s restarted in place (restart %d of attempt %d)", job.id, record.restart, attempt)
    return True


def _checkpoint_time(session: Session, job: Job, attempt: int, step: int | None) -> float | None:
    """When the checkpoint of `step` was saved, if its save was not noted: when rank 0 reported that
    step (None: not known)."""
    if step is None:
        return None
    query = select(func.min(JobMetric.time)).where(
        col(JobMetric.job_id) == job.id, col(JobMetric.attempt) == attempt, col(JobMetric.step) == step
    )
    with session.no_autoflush:
        found = session.exec(query).one()
    return found.timestamp() if found is not None else None


def _back_to_training(job: Job) -> bool:
    """The first step reported after the latest restart closes its downtime (rank 0's report times)."""
    log_ = job.restart_log or []
    latest = next((i for i in range(len(log_) - 1, -1, -1) if log_[i].get("outcome") == "restarted"), None)
    if latest is None or "first_step_at" in log_[latest] or log_[latest].get("started_at") is None:
        return False
    after = [at for at in job.report_times or [] if at >= float(log_[latest]["started_at"])]
    if not after:
        return False
    closed = {**log_[latest], "first_step_at": min(after)}
    job.restart_log = [*log_[:latest], closed, *log_[latest + 1 :]]
    return True


def request_restart(session: Session, job: Job, summary: str) -> bool:
    """The hung `job` (flagged stalled, `on_stall: "fail"`): ask its supervisor to restart its current
    run in place when its policy covers `hang` and has restarts left. True when asked (now or
    before: never twice for one run); False when the attempt must end as before."""
    policy = restarts.policy_of(job.spec)
    attempt = job.run_attempt or job.attempt
    run = restarts.runs_seen(job.restart_log, attempt)
    if "hang" not in policy.on or run >= policy.max or job.folder is None:
        return False
    files = JobFiles(Path(job.folder))
    asked = read_restart_request(files)
    if asked is not None and (asked.attempt, asked.run) == (attempt, run):
        return True
    write_restart_request(files, RestartRequest(attempt=attempt, run=run, cause="hang", detail=summary[:500]))
    record_restart(session, job, f"stalled: restart in place requested (restart {run + 1} of {policy.max})",
                   notify=False)  # fmt: skip
    return True
