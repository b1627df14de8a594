"""A webhook's body and headers (service.domain.webhook_events): GitHub-style signature, a `text` line."""

from __future__ import annotations

import hashlib
import hmac
import json
from datetime import datetime, timezone

from service.domain import webhook_events

TIME = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
JOB = {
    "id": 12,
    "name": "train",
    "owner": "alice",
    "created_at": TIME,
    "started_at": None,
    "finished_at": TIME,
}


def test_the_signature_is_hmac_sha256_of_the_raw_body() -> None:
    body = webhook_events.body_bytes({"event": "job.failed", "text": "é"})
    expected = hmac.new(b"k" * 32, body, hashlib.sha256).hexdigest()
    assert webhook_events.sign("k" * 32, body) == f"sha256={expected}"
    assert webhook_events.verify("k" * 32, body, f"sha256={expected}")
    assert not webhook_events.verify("k" * 31 + "x", body, f"sha256={expected}")
    assert not webhook_events.verify("k" * 32, body + b" ", f"sha256={expected}")
    headers = webhook_events.headers("k" * 32, body, "d-1", "job.failed")
    assert headers["X-Torchyard-Signature"] == f"sha256={expected}"
    assert headers["X-Torchyard-Delivery"] == "d-1" and headers["X-Torchyard-Event"] == "job.failed"
    assert headers["Content-Type"] == "application/json" and headers["User-Agent"] == "torchyard-webhook"


def test_a_job_event_and_its_text() -> None:
    reason = "attempt 2 ended (failure): boom\nTraceback (most recent call last): ..."
    event = webhook_events.job_event(JOB, "failed", reason, 2, TIME, "https://ty.example.org")
    assert event["event"] == "job.failed" and event["time"] == TIME.isoformat()
    assert event["job"] == {
        "id": 12, "name": "train", "owner": "alice", "state": "failed", "reason": reason, "attempt": 2,
        "created_at": TIME.isoformat(), "started_at": None, "finished_at": TIME.isoformat(),
        "pipeline_id": None, "url": "https://ty.example.org/#/jobs/12",
    }  # fmt: skip
    assert event["text"] == (
        'job 12 "train" failed (attempt 2): attempt 2 ended (failure): boom https://ty.example.org/#/jobs/12'
    )
    json.dumps(event)  # JSON as it is
    quiet = webhook_events.job_event(JOB, "succeeded", None, 1, TIME, "http://h:1")
    assert quiet["text"] == 'job 12 "train" succeeded http://h:1/#/jobs/12'
    long = webhook_events.job_event(JOB, "failed", "x" * 1000, 1, TIME, "http://h:1")
    assert len(long["text"]) < 400


def test_a_pipeline_event() -> None:
    row = {"id": 3, "name": "etl", "owner": "bob", "created_at": TIME, "finished_at": None}
    event = webhook_events.pipeline_event(row, "failed", "stage train failed", TIME, "http://h:1")
    assert event["event"] == "pipeline.failed" and event["pipeline"]["url"] == "http://h:1/#/pipelines/3"
    assert event["text"] == 'pipeline 3 "etl" failed: stage train failed http://h:1/#/pipelines/3'
