"""What a webhook receives: the event's JSON (with a `text` line, so that a Slack or Mattermost
incoming webhook shows it as it is), its headers, and its signature. Pure.

The signature is GitHub's: `X-Torchyard-Signature: sha256=<hex>`, the HMAC-SHA256 of the raw body
with the subscription's secret. A receiver computes the same over the bytes it got and compares in
constant time (README: Notifications); `X-Torchyard-Delivery` is the same on every resend of one
delivery, the receiver's key to drop a duplicate.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import datetime
from typing import Any

SIGNATURE = "X-Torchyard-Signature"
DELIVERY = "X-Torchyard-Delivery"
EVENT = "X-Torchyard-Event"
USER_AGENT = "torchyard-webhook"
MAX_REASON = 300  # characters of a reason's first line in `text`


def event_name(kind: str, state: str) -> str:
    """`job.failed`, `pipeline.succeeded`."""
    return f"{kind}.{state}"


def job_event(
    job: dict[str, Any], state: str, reason: str | None, attempt: int | None, time: datetime, dashboard: str
) -> dict[str, Any]:
    """The body (less its delivery_id) of a job's event: `job` holds the row's id, name, owner and
    times; the state, reason and attempt are the notice's (the job may have moved on since)."""
    url = f"{dashboard}/#/jobs/{job['id']}"
    body = {
        "id": job["id"],
        "name": job["name"],
        "owner": job["owner"],
        "state": state,
        "reason": reason,
        "attempt": attempt,
        "created_at": _iso(job.get("created_at")),
        "started_at": _iso(job.get("started_at")),
        "finished_at": _iso(job.get("finished_at")),
        "pipeline_id": job.get("pipeline_id"),
        "url": url,
    }
    tried = f" (attempt {attempt})" if attempt and attempt > 1 else ""
    text = f'job {job["id"]} "{job["name"]}" {state}{tried}{_because(reason)} {url}'
    return {"event": event_name("job", state), "text": text, "job": body, "time": time.isoformat()}


def pipeline_event(
    pipeline: dict[str, Any], state: str, reason: str | None, time: datetime, dashboard: str
) -> dict[str, Any]:
    """The body (less its delivery_id) of a pipeline's event."""
    url = f"{dashboard}/#/pipelines/{pipeline['id']}"
    body = {
        "id": pipeline["id"],
        "name": pipeline["name"],
        "owner": pipeline["owner"],
        "state": state,
        "reason": reason,
        "created_at": _iso(pipeline.get("created_at")),
        "finished_at": _iso(pipeline.get("finished_at")),
        "url": url,
    }
    text = f'pipeline {pipeline["id"]} "{pipeline["name"]}" {state}{_because(reason)} {url}'
    return {"event": event_name("pipeline", state), "text": text, "pipeline": body, "time": time.isoformat()}


def body_bytes(payload: dict[str, Any]) -> bytes:
    """The bytes sent (and signed): the stored payload as compact JSON."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def sign(secret: str, body: bytes) -> str:
    """The X-Torchyard-Signature value of `body`."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify(secret: str, body: bytes, signature: str) -> bool:
    """What a receiver does (and the tests): the signature recomputed, compared in constant time."""
    return hmac.compare_digest(sign(secret, body), signature)


def headers(secret: str, body: bytes, delivery_id: str, event: str) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        SIGNATURE: sign(secret, body),
        DELIVERY: delivery_id,
        EVENT: event,
    }


def _because(reason: str | None) -> str:
    if not reason:
        return ""
    line = reason.strip().splitlines()[0] if reason.strip() else ""
    if len(line) > MAX_REASON:
        line = line[: MAX_REASON - 1] + "…"
    return f": {line}" if line else ""


def _iso(value: Any) -> str | None:
    return value.isoformat() if isinstance(value, datetime) else value
