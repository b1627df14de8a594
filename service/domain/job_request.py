"""A job request as admission's first and third steps see it: its shape against this service's limits
(and the backend it goes to), and the row the intake stores for it (service.domain.submit)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.backends.base import Backend
from service.config import Settings
from service.domain.dependencies import waiting_reason
from service.domain.jobs import require_backend
from service.errors import InvalidRequest
from service.ledger.models.jobs import JobCreate, NewJob
from service.states import JobState


def check_request(payload: JobCreate, settings: Settings, backends: Mapping[str, Backend]) -> str:
    """Validate what pydantic cannot know (this service's limits, the backend's node limit); return
    the name of the backend the job goes to."""
    res = payload.resources
    limits = [
        ("resources.nodes", res.nodes, settings.max_nodes),
        ("resources.tasks_per_node", res.tasks_per_node, settings.max_tasks_per_node),
        ("resources.gpus_per_node", res.gpus_per_node, settings.max_gpus_per_node),
        ("resources.timeout_min", res.timeout_min, settings.max_timeout_min),
    ]
    for field, value, maximum in limits:
        if value > maximum:
            raise InvalidRequest(f"is {value}, above this service's maximum of {maximum}", field=field)
    name = payload.backend or settings.default_backend
    most = require_backend(backends, name).max_nodes
    if most is not None and res.nodes > most:
        nodes = "one node" if most == 1 else f"at most {most} nodes"
        roomier = sorted(n for n, b in backends.items() if b.max_nodes is None or b.max_nodes >= res.nodes)
        hint = f"; use backend '{roomier[0]}' for more" if roomier else ""
        raise InvalidRequest(f"the {name} backend runs on {nodes}{hint}", field="resources.nodes")
    if most is not None and res.spare_nodes and res.nodes + res.spare_nodes > most:
        # A spare waits idle in the allocation for a lost node: a backend of `most` nodes has none.
        room = "one node" if most == 1 else f"at most {most} nodes"
        raise InvalidRequest(
            f"the {name} backend runs on {room}: no room for {res.spare_nodes} spare node(s)",
            field="resources.spare_nodes",
        )
    return name


def new_job_row(
    payload: JobCreate,
    owner: str,
    backend: str,
    idempotency_key: str | None = None,
    *,
    run_as: str | None = None,
) -> NewJob:
    # What the ranks get: not whom it runs after (the ledger's JobDependency rows; the ranks read what
    # those jobs left as ctx.upstream).
    # Nor its webhooks: subscriptions, bound to it by the intake.
    spec = payload.model_dump(exclude={"name", "backend", "retries", "after", "notify"}, mode="json")
    # Absent rather than null: a job without them reads as before.
    for optional in ("code", "python", "watchdog"):
        if spec[optional] is None:
            del spec[optional]
    return NewJob(
        name=payload.name,
        owner=owner,
        backend=backend,
        spec=spec,
        run_as=run_as,
        idempotency_key=idempotency_key,
        retries=payload.retries.model_dump(mode="json"),
        after=tuple(payload.after),
        notify=tuple(payload.notify),
    )


def new_job_values(row: NewJob, sweep_id: int | None) -> dict[str, Any]:
    """Every column a new job starts with, as the intake inserts it (Core applies no model defaults,
    so all are spelled out): queued, or waiting when it runs after others."""
    return {
        "name": row.name,
        "owner": row.owner,
        "run_as": row.run_as,
        "backend": row.backend,
        "spec": row.spec,
        "state": (JobState.waiting if row.after else JobState.queued).value,
        "reason": waiting_reason((one.job, one.on) for one in row.after) if row.after else None,
        "exit_code": None,
        "external_id": None,
        "folder": None,
        "attempt": 1,
        "run_attempt": None,
        "retries": row.retries,
        "retry_at": None,
        "nodes": None,
        "placement": None,
        "attempt_started_at": None,
        "expected_start_at": None,
        "result": None,
        "progress": None,
        "progress_offset": 0,
        "latest_checkpoint": row.resume_from,
        "cancel_requested": False,
        "claimed_by": None,
        "claimed_at": None,
        "idempotency_key": row.idempotency_key,
        "sweep_id": sweep_id,
        "params": row.params,
        "resumes": row.resumes,
        "pipeline_id": row.pipeline_id,
        "stage": row.stage,
        "restart_count": 0,
        "restarts_offset": 0,
        "restart_log": None,
        "goodput": None,
        "created_at": row.created_at,
        "updated_at": row.created_at,
        "submitted_at": None,
        "started_at": None,
        "finished_at": None,
    }
