"""The job page shows the watchdog's flag in real Chromium: "stalled" beside the state, and the reason
(which rank is where) as text, however the job named its functions; the flag goes when the ranks move
again. The ranks here are a scripted backend's, writing the activity and stacks files real ranks write
(the watchdog on real ranks: tests/integration/test_watchdog_local.py)."""

from __future__ import annotations

import json
import time
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
from worker.spec import JobFiles

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
"""


def _activity(files: JobFiles, changed_ago_s: float) -> None:
    now = time.time()
    for rank in range(3):
        files.activity(rank).parent.mkdir(exist_ok=True)
        record = {"attempt": 1, "rank": rank, "host": "n2", "pid": 1000 + rank, "time": now,
                  "changed_at": now - changed_ago_s, "where": "/job/code/train.py:30 main"}  # fmt: skip
        files.activity(rank).write_text(json.dumps(record) + "\n")


def test_a_stalled_job_is_flagged_with_its_reason_as_text_until_it_moves(
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
        body = {"name": "hung", "entrypoint": "worker.tasks.faults:sleep", "resources": {"tasks_per_node": 3},
                "watchdog": {"stall_after_s": 15}}  # fmt: skip
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
            expect(page.locator(".job-head .badge")).to_have_text("running")
            expect(page.locator(".stalled-flag")).to_have_count(0)
            _activity(files, changed_ago_s=600)  # alive, standing still for 10 minutes
            wait_for(lambda: job(fresh, job_id)["stalled_at"] is not None, timeout=60, what="the flag")
            expect(page.locator(".stalled-flag")).to_have_text("stalled")
            box = page.locator(".reason-stalled")
            expect(box).to_contain_text("Stalled since")
            expect(box).to_contain_text(f"rank 1 on n2 in loader.py:41 {HOSTILE}")
            expect(page.locator(".job-head .badge")).to_have_text("running")  # a flag, not a state
            expect(page.locator("img")).to_have_count(0)
            assert page.evaluate("window.pwned") is None
            shot(page, tmp_path, "job-stalled")

            _activity(files, changed_ago_s=0)  # the ranks move again
            expect(page.locator(".stalled-flag")).to_have_count(0, timeout=30_000)
            expect(page.locator(".reason-stalled")).to_be_hidden()
