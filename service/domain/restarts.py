"""Restarts in place as the service tells them: the words of a restart's event, the job's record of
its restarts (Job.restart_log, bounded), how many the current attempt has had. Pure: no session, no
file. What a supervisor that gave up adds to its attempt's ending: service.domain.endings.given_up.

The supervisor (worker.supervisor, the job's account, inside the allocation) restarts the ranks and
appends a RestartRecord to restarts.jsonl; service.loops.restarts reads those into the ledger."""

from __future__ import annotations

from typing import Any

from worker.spec import RestartPolicy, RestartRecord

MAX_LOG = 200  # records kept on a job (the newest); an attempt has at most 100 restarts and 1 give-up
RESTARTED = "restarted"
GAVE_UP = "gave_up"


def policy_of(spec: dict[str, Any]) -> RestartPolicy:
    """The job's restart policy from its stored spec (defaults for a job stored before restarts)."""
    return RestartPolicy.model_validate(spec.get("restarts") or {})


def describe(record: RestartRecord, limit: int | None) -> str:
    """A restart's event: "rank 1 on n2 lost (node down); restarted in place on n1,n3 in 6.2 s from
    step 40, restart 1 of 2"."""
    lost = loss(record.model_dump())
    nodes = f" on {','.join(record.nodes)}" if record.nodes else ""
    took = ""
    if record.lost_at is not None and record.started_at is not None:
        took = f" in {max(0.0, record.started_at - record.lost_at):.1f} s"
    step = record.resumed_step
    start = f" from step {step}" if step is not None else " from the start" if not record.resumed_from else ""
    most = limit if limit is not None else record.max
    of = f" of {most}" if most is not None else ""
    return f"{lost}; restarted in place{nodes}{took}{start}, restart {record.restart}{of}"


def loss(record: dict[str, Any]) -> str:
    """What a record says was lost, in words: "rank 1 on n2 lost (node down)", "stalled (...)"."""
    rank, node, detail, cause = (record.get(key) for key in ("rank", "node", "detail", "cause"))
    who = f"rank {rank}" if rank is not None else "a rank"
    where = f" on {node}" if node else ""
    why = f" ({detail})" if detail else f" ({cause})"
    return f"{who}{where} lost{why}" if cause != "hang" else f"stalled{why}"


def describe_give_up(record: RestartRecord, limit: int | None) -> str:
    """Why the supervisor stopped restarting: "restarts spent (2 of 2)", or its own reason."""
    if record.reason:
        return record.reason
    most = limit if limit is not None else record.max
    return f"restarts spent ({record.restart} of {most})" if most is not None else "restarts spent"


def entry(record: RestartRecord, **derived: float | None) -> dict[str, Any]:
    """A record as Job.restart_log keeps it, with what the service worked out of it (`derived`:
    checkpoint_at, run_start, first_step_at: for goodput)."""
    kept = record.model_dump(exclude_none=True, exclude={"nodes"} if not record.nodes else None)
    kept.update({name: value for name, value in derived.items() if value is not None})
    return kept


def appended(log: list[dict[str, Any]] | None, kept: dict[str, Any]) -> list[dict[str, Any]]:
    """A new list (the column is JSON: a copy is what marks it changed), the oldest past MAX_LOG dropped."""
    return [*(log or []), kept][-MAX_LOG:]


Log = list[dict[str, Any]]


def of_attempt(log: Log | None, attempt: int, outcome: str = RESTARTED) -> Log:
    return [one for one in log or [] if one.get("attempt") == attempt and one.get("outcome") == outcome]


def runs_seen(log: list[dict[str, Any]] | None, attempt: int) -> int:
    """Restarts of `attempt` the service has read: the RestartRequest's `run` for its current run."""
    return max((int(one.get("restart", 0)) for one in of_attempt(log, attempt)), default=0)
