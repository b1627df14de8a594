"""A rank whose node does not protect hard links says so in its placement file; the reconcile loop
reads it, warns once per host and counts such hosts in /metrics (issue 35)."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from tests.api.test_metrics import sample
from tests.fakes import FakeBackend
from tests.support import submit, wait_for, wait_state


def test_a_node_without_protected_hard_links_is_warned_about_and_counted(
    api: TestClient, fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    for host in ("gpu-7", "gpu-7"):  # two jobs on the same node: one warning
        job_id = submit(api)["id"]
        wait_state(api, job_id, "running")
        files = fake.specs[job_id].files
        record = {"attempt": 1, "rank": 0, "host": host, "local_rank": 0, "protected_hardlinks": False}
        files.placement(0).parent.mkdir(exist_ok=True)
        files.placement(0).write_text(json.dumps(record))
        url = f"/api/v1/jobs/{job_id}"
        placed = wait_for(lambda url=url: api.get(url).json()["placement"], what="placement")
        assert placed[0]["protected_hardlinks"] is False

    warned = [r for r in caplog.records if "protected_hardlinks" in r.getMessage()]
    assert len(warned) == 1 and "gpu-7" in warned[0].getMessage()
    assert sample(api.get("/metrics").text, "torchyard_nodes_unprotected_hardlinks") == 1
