"""The job page's Stacks card in real Chromium: Capture shows every rank's stacks grouped, the odd rank
first; what a rank wrote is shown as text (a function named like HTML stays text); an ended job shows
its last capture and no Capture button to press. The ranks here are a scripted backend's (the real
ones: tests/integration/test_stacks_local.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from service.app import create_app
from service.backends.base import StackRequest
from service.config import Settings
from tests.browser.conftest import job, open_page, shot, token
from tests.fakes import FakeBackend
from tests.serving import serve
from tests.support import bearer, wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Browser

pytestmark = pytest.mark.browser

HOSTILE = "<img src=x onerror=window.pwned=1>"
STUCK = f"""\
Current thread 0x00007f3b938d2040 (most recent call first):
  File "/job/code/loader.py", line 41 in {HOSTILE}
  File "/job/code/train.py", line 30 in main
"""
WAITING = """\
Current thread 0x00007f3b938d2040 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce
  File "/job/code/train.py", line 88 in step
  File "/job/code/train.py", line 30 in main
"""


def test_capture_shows_the_stacks_grouped_as_text_and_an_ended_job_its_last(
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
        body = {"name": "hung", "entrypoint": "worker.tasks.faults:sleep", "resources": {"tasks_per_node": 3}}
        response = httpx.post(f"{fresh.url}/api/v1/jobs", json=body, headers=bearer(token(fresh)))
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        wait_for(lambda: job(fresh, job_id)["state"] == "running", what="running")
        files = fake.specs[job_id].files

        def ranks_dump(_: StackRequest) -> bool:
            for rank, text in ((0, WAITING), (1, STUCK), (2, WAITING)):
                files.stacks(rank).parent.mkdir(exist_ok=True)
                with files.stacks(rank).open("a") as out:
                    out.write(text)
            return True

        fake.on_stacks = ranks_dump
        with open_page(browser, fresh.url, token(fresh)) as page:
            page.goto(f"/#/jobs/{job_id}")
            card = page.locator("section[data-card='stacks']")
            button = card.locator("button[data-action='capture-stacks']")
            expect(button).to_be_enabled()
            button.click()
            expect(card.locator(".stacks-summary")).to_contain_text("rank 1")
            expect(card.locator(".stack-group")).to_have_count(2)
            expect(card.locator(".stack-group summary").nth(0)).to_have_text("rank 1")
            expect(card.locator(".stack-group summary").nth(1)).to_have_text("ranks 0, 2")
            expect(card.locator(".stack-group").nth(0)).to_contain_text(f"loader.py:41 {HOSTILE}")
            expect(card.locator("img")).to_have_count(0)  # the name stayed text
            expect(card.locator(".stacks-body")).not_to_contain_text("null")
            assert page.evaluate("window.pwned") is None
            shot(page, tmp_path, "job-stacks")

            fake.finish(job_id, {"ok": True})
            expect(page.locator(".job-head .badge")).to_have_text("succeeded")
            expect(button).to_be_disabled()
            page.reload()
            expect(card.locator(".stacks-body .muted").first).to_contain_text("last capture")
            expect(card.locator(".stack-group")).to_have_count(2)
    assert len(fake.stack_calls) == 1
