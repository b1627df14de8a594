"""The client's pipeline calls (a mixin of TorchyardClient): submit, read, cancel, retry, wait."""

from __future__ import annotations

import time
from typing import Any

from service.client.wire import Spec, WaitTimeout, spec_body

Pipeline = dict[str, Any]


class Pipelines:
    """POST/GET /api/v1/pipelines/...; the plumbing is TorchyardClient's."""

    def _object(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        raise NotImplementedError

    def submit_pipeline(self, pipeline: Spec, idempotency_key: str | None = None) -> Pipeline:
        """POST /api/v1/pipelines: {"name", "stages": [{"name", "job" | "sweep", "after", "on"}]};
        returns the pipeline with its stages (each stage's job or sweep stored, waiting its turn)."""
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self._object("POST", "/api/v1/pipelines", json=spec_body(pipeline), headers=headers)

    def pipelines(self, limit: int = 50, cursor: str | None = None) -> dict[str, Any]:
        """One page of pipelines, newest first: {"items": [...], "next_cursor": ...}."""
        params: dict[str, Any] = {"limit": limit, **({"cursor": cursor} if cursor else {})}
        return self._object("GET", "/api/v1/pipelines", params=params)

    def pipeline(self, pipeline_id: int) -> Pipeline:
        """The pipeline: its state and reason, its stages with their job or sweep and state."""
        return self._object("GET", f"/api/v1/pipelines/{pipeline_id}")

    def cancel_pipeline(self, pipeline_id: int) -> Pipeline:
        """Cancel every job of it that has not ended; idempotent."""
        return self._object("POST", f"/api/v1/pipelines/{pipeline_id}/cancel")

    def retry_pipeline(self, pipeline_id: int, start: str) -> Pipeline:
        """Run stage `start` and every stage after it again (new jobs); the stages before keep theirs."""
        return self._object("POST", f"/api/v1/pipelines/{pipeline_id}/retry", json={"from": start})

    def wait_pipeline(
        self, pipeline_id: int, poll_s: float = 1.0, timeout_s: float | None = None
    ) -> Pipeline:
        """Until the pipeline has ended (succeeded, failed or cancelled); returns it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (pipeline := self.pipeline(pipeline_id))["state"] == "running":
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"pipeline {pipeline_id} still running after {timeout_s} s")
            time.sleep(poll_s)
        return pipeline
