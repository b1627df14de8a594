"""The job page tells a restart in place in real Chromium (issue 44): its count and policy, the event
in the state history in words, and the goodput bar with a downtime part beside training. The ranks
here are a scripted backend's; the restart record is written as the job's supervisor writes it."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from tests.browser.conftest import job, open_page, shot, token
from tests.fakes import FakeBackend
from tests.serving import serve
from tests.support import bearer, wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = pytest.mark.browser


def test_a_restart_in_place_shows_in_the_facts_the_history_and_the_goodput_bar(
    browser: Browser, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        data_dir=tmp_path / "data",
        job_accounts="service",
        local_reconcile_interval_s=0.05,
        dispatch_interval_s=0.1,
    )
    fake = FakeBackend("local")
    with serve(create_app(settings, backends={"local": fake})) as fresh:
        body = {
            "name": "restarted",
            "entrypoint": "worker.tasks.faults:sleep",
            "resources": {"tasks_per_node": 2},
        }
        response = httpx.post(f"{fresh.url}/api/v1/jobs", json=body, headers=bearer(token(fresh)))
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        wait_for(lambda: job(fresh, job_id)["state"] == "running", what="running")
        time.sleep(1.0)  # some training before the loss
        with open_page(browser, fresh.url, token(fresh)) as page:
            page.goto(f"/#/jobs/{job_id}")
            facts = page.locator(".facts")
            expect(facts.locator("dt:text-is('Restarts') + dd")).to_have_text(
                "0 in place (at most 2 an attempt, on node_failure, hang)"
            )
            now = time.time()
            record = {"attempt": 1, "restart": 1, "outcome": "restarted", "cause": "node_failure", "rank": 1,
                      "node": "n2", "detail": "killed by SIGKILL", "lost_at": now - 0.8, "started_at": now,
                      "nodes": ["n1"], "max": 2}  # fmt: skip
            fake.specs[job_id].files.restarts.write_text(json.dumps(record) + "\n")
            expect(facts.locator("dt:text-is('Restarts') + dd")).to_contain_text("1 in place")
            expect(page.locator(".events tbody").last).to_contain_text(
                "rank 1 on n2 lost (killed by SIGKILL); restarted in place on n1 in 0.8 s from the start, "
                "restart 1 of 2"
            )
            bar = facts.locator("dt:text-is('Goodput') + dd .goodput")
            expect(bar.locator(".part-recomputed")).to_have_count(1)  # from the start: the run before, lost
            expect(bar.locator(".part-downtime")).to_have_count(1)
            expect(bar.locator(".label")).to_contain_text("% training")
            shot(page, tmp_path, "job-restarted")
