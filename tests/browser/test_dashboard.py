"""The dashboard in real Chromium against the real service, real local processes and real training."""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING
from zoneinfo import ZoneInfo

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.states import JobState
from tests.browser.conftest import ADMIN, TIMEZONE, job, open_page, shot, submit, token
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve
from tests.support import bearer, wait_for

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.browser

TRAIN = "worker.tasks.train:train"
SLEEP = "worker.tasks.faults:sleep"
RAISE = "worker.tasks.faults:raise_on_rank"
SLOW_MS = 60_000  # a fresh job imports torch in every rank on a small machine: allow for it


def test_the_jobs_page_lists_jobs_submitted_through_the_api(page: Page, service: LiveServer) -> None:
    from playwright.sync_api import expect

    ids = [submit(service, f"listed-{n}", SLEEP, seconds=1) for n in range(2)]
    page.goto("/")
    for job_id in ids:
        row = page.locator(f'tr[data-job-id="{job_id}"]')
        expect(row).to_be_visible()
        expect(row.locator(".name")).to_have_text(f"listed-{job_id - ids[0]}")
    newest_first = page.locator("tr.job-row").evaluate_all("rows => rows.map(r => Number(r.dataset.jobId))")
    assert newest_first == sorted(newest_first, reverse=True)
    expect(page.locator("tr.job-row .badge").first).to_be_visible()

    page.fill("input.search", "listed-1")  # the name filter, then back to everything
    expect(page.locator("tr.job-row")).to_have_count(1)
    page.fill("input.search", "li")  # shorter than the service searches by: a hint, the list as it was
    expect(page.locator(".search-hint")).to_have_text("Type 3 or more characters")
    expect(page.locator("tr.job-row")).to_have_count(1)
    page.fill("input.search", "no-such-job")
    expect(page.locator(".search-hint")).to_be_hidden()
    expect(page.locator(".empty-state h2")).to_have_text("No jobs match these filters")
    page.fill("input.search", "")
    expect(page.locator(f'tr[data-job-id="{ids[0]}"]')).to_be_visible()

    for job_id in ids:  # they end on their own, and the table follows without a reload
        expect(page.locator(f'tr[data-job-id="{job_id}"] .badge')).to_have_text("succeeded", timeout=SLOW_MS)
    page.click('button[data-filter="succeeded"]')
    expect(page).to_have_url(re.compile(r"state=succeeded"))
    # expect() waits for the filtered page to render: the click only starts its fetch
    expect(page.locator("tr.job-row .badge")).to_have_text(["succeeded"] * 2)


def test_a_training_job_moves_live_to_succeeded(page: Page, service: LiveServer, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    job_id = submit(service, "train-live", TRAIN, ranks=2, epochs=4, sleep_per_step=0.25)
    page.goto(f"/#/jobs/{job_id}")
    page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads
    progress = page.locator(".progress-card .progress[data-step]")
    chart = page.locator(".chart-box")

    expect(progress).to_be_visible(timeout=SLOW_MS)
    first_step = int(progress.get_attribute("data-step") or 0)
    first_points = int(chart.get_attribute("data-points") or 0)
    page.wait_for_function(
        "([step, points]) => {"
        " const bar = document.querySelector('.progress-card .progress[data-step]');"
        " const box = document.querySelector('.chart-box');"
        " return bar && Number(bar.dataset.step) > step && Number(box.dataset.points) > points; }",
        arg=[first_step, first_points],
        timeout=SLOW_MS,
    )
    assert page.locator(".chart path.line").count() >= 1
    expect(page.locator(".legend-item[data-metric='loss']")).to_be_visible()
    expect(page.locator(".job-head .badge")).to_have_text("running")
    shot(page, tmp_path, "job-running")

    expect(page.locator(".job-head .badge")).to_have_text("succeeded", timeout=SLOW_MS)
    assert page.evaluate("window.__sameDocument") is True
    expect(progress).to_have_attribute("data-step", "32")
    expect(page.locator("pre.result")).to_contain_text('"ok": true')
    expect(page.locator(".events tr[data-to='succeeded']")).to_be_visible()
    expect(page.locator("button[data-action='cancel']")).to_have_count(0)  # terminal: nothing to cancel
    # The folder's size, measured by the service once the job ended (within seconds), not by the page.
    disk = page.locator(".facts dt:text-is('Disk') + dd")
    expect(disk).to_have_text(re.compile(r"^\d+(\.\d)? (KB|MB) \(measured "), timeout=SLOW_MS)

    page.select_option("select[name='rank']", "1")
    expect(page.locator("pre.log")).to_contain_text("global_rank=1")  # rank 1's own stdout (its first line)
    page.select_option("select[name='stream']", "err")
    expect(page.locator("pre.log")).to_contain_text("[rank 1]")
    shot(page, tmp_path, "job-succeeded")

    created = datetime.fromisoformat(job(service, job_id)["created_at"]).astimezone(ZoneInfo(TIMEZONE))
    shown = page.locator(".facts dt:text-is('Created') + dd").inner_text()
    assert shown.startswith(f"{created.month}/{created.day}/{created.year}, {created.hour % 12 or 12}:")


def test_cancel_from_the_page_stops_a_running_job(page: Page, service: LiveServer) -> None:
    from playwright.sync_api import expect

    job_id = submit(service, "to-cancel", SLEEP, ranks=2, seconds=300)
    page.goto(f"/#/jobs/{job_id}")
    expect(page.locator(".job-head .badge")).to_have_text("running", timeout=SLOW_MS)

    page.click("button[data-action='cancel']")
    dialog = page.locator("dialog.confirm")
    expect(dialog).to_be_visible()
    expect(dialog).to_contain_text("to-cancel")
    page.click("dialog.confirm button[value='keep']")  # changing one's mind cancels nothing
    expect(dialog).to_be_hidden()
    assert job(service, job_id)["state"] == "running"

    page.click("button[data-action='cancel']")
    page.click("button[data-action='confirm-cancel']")
    expect(page.locator(".job-head .badge")).to_have_text("cancelled", timeout=SLOW_MS)
    assert job(service, job_id)["state"] == "cancelled"
    pid = job(service, job_id)["external_id"]
    wait_for(lambda: not _alive(pid), timeout=15, what=f"job {job_id}'s processes to end")


def test_a_failed_job_shows_its_reason(page: Page, service: LiveServer, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    job_id = submit(service, "fails-on-rank-1", RAISE, ranks=2, rank=1, message="the data loader broke")
    page.goto("/")
    row = page.locator(f'tr[data-job-id="{job_id}"]')
    expect(row.locator(".badge")).to_have_text("failed", timeout=SLOW_MS)
    expect(row.locator(".reason")).to_contain_text("rank 1")
    shot(page, tmp_path, "jobs")

    row.click()
    expect(page).to_have_url(re.compile(rf"#/jobs/{job_id}$"))
    reason = page.locator(".reason-box")
    expect(reason).to_be_visible()
    expect(reason).to_contain_text("the data loader broke (rank 1)")
    expect(page.locator("select[name='stream']")).to_have_value("err")
    shot(page, tmp_path, "job-failed")


def test_empty_filters_unknown_jobs_and_api_errors_are_shown(page: Page, service: LiveServer) -> None:
    from playwright.sync_api import expect

    page.goto("/#/?state=timeout")
    expect(page.locator(".empty-state h2")).to_have_text("No jobs match these filters")
    page.goto("/#/jobs/999999")
    expect(page.locator(".empty-state h2")).to_have_text("Job 999999 not found")
    expect(page.locator("#banner")).to_contain_text("job 999999 not found")
    expect(page.locator("#status")).to_have_attribute("data-kind", "error")
    page.click(".empty-state a")
    expect(page.locator("#status")).to_have_attribute("data-kind", "live")
    expect(page.locator("#banner")).to_be_hidden()


def test_a_fresh_service_shows_a_clear_empty_state(browser: Browser, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        data_dir=tmp_path / "data",
        job_accounts="service",
    )
    with (
        serve(create_app(settings, backends={"local": FakeBackend("local")})) as fresh,
        open_page(browser, fresh.url, token(fresh)) as page,
    ):
        page.goto("/")
        expect(page.locator(".empty-state h2")).to_have_text("No jobs yet")
        expect(page.locator("#status")).to_have_attribute("data-kind", "live")
        shot(page, tmp_path, "empty")


def test_pages_of_many_jobs_by_cursor(browser: Browser, tmp_path: Path) -> None:
    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        data_dir=tmp_path / "data",
        job_accounts="service",
    )
    with serve(create_app(settings, backends={"local": FakeBackend("local")})) as fresh:
        for n in range(60):
            submit(fresh, f"many-{n}", SLEEP)
        with open_page(browser, fresh.url, token(fresh)) as page:
            _page_through(page)


def _page_through(page: Page) -> None:
    from playwright.sync_api import expect

    page.goto("/#/?limit=25")
    rows = page.locator("tr.job-row")
    expect(rows).to_have_count(25)
    expect(rows.first).to_have_attribute("data-job-id", "60")
    page.click("button[data-action='older']")
    expect(rows.first).to_have_attribute("data-job-id", "35")
    page.click("button[data-action='older']")
    expect(rows).to_have_count(10)
    expect(page.locator("button[data-action='older']")).to_be_disabled()
    page.click("text=← Newer")
    expect(rows.first).to_have_attribute("data-job-id", "35")
    page.click("text=⇤ Newest")
    expect(rows.first).to_have_attribute("data-job-id", "60")


def _alive(pid: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone before the open (ENOENT), or between the open and the read (ESRCH)
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def test_a_retried_job_lists_its_attempts(browser: Browser, tmp_path: Path) -> None:
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
        body = {"name": "retried", "entrypoint": SLEEP, "retries": {"max": 2, "backoff_s": 3},
                "resources": {"tasks_per_node": 2}}  # fmt: skip
        response = httpx.post(f"{fresh.url}/api/v1/jobs", json=body, headers=bearer(token(fresh)))
        assert response.status_code == 201, response.text
        job_id = response.json()["id"]
        wait_for(lambda: job(fresh, job_id)["state"] == "running", what="running")
        files = fake.specs[job_id].files
        files.placement(0).parent.mkdir()
        for rank in (0, 1):
            placed = {"attempt": 1, "rank": rank, "host": f"n{rank + 1}", "local_rank": 0, "gpu": None}
            files.placement(rank).write_text(json.dumps(placed))
        fake.set_status(job_id, JobState.running, nodes="n[1-2]")
        wait_for(lambda: job(fresh, job_id)["placement"], what="where its ranks run")
        with open_page(browser, fresh.url, token(fresh)) as page:
            page.goto(f"/#/jobs/{job_id}")
            expect(page.locator(".facts dt:text-is('Ranks') + dd")).to_have_text("0 on n1; 1 on n2")
            fake.set_status(job_id, JobState.failed, "node failure", kind="node_failure")
            expect(page.locator(".job-head .badge")).to_have_text("retrying")
            expect(page.locator(".reason-box strong")).to_contain_text("Retrying: attempt 2 goes out at")
            expect(page.locator(".facts dt:text-is('Attempt') + dd")).to_have_text("2 of at most 3")
            expect(page.locator(".facts dt:text-is('Ranks') + dd")).to_have_text("—")  # attempt 2's: none yet
            rows = page.locator(".attempts tbody tr")
            expect(rows).to_have_count(2)
            expect(rows.nth(0).locator(".badge")).to_have_text("failed")
            expect(rows.nth(0)).to_contain_text("node failure")
            expect(rows.nth(0)).to_contain_text("n[1-2]")
            expect(rows.nth(1).locator(".badge")).to_have_text("retrying")
            expect(page.locator(".job-head .badge")).to_have_text("running", timeout=15_000)
            fake.set_status(job_id, JobState.running, nodes="n[3-4]")  # attempt 2 runs elsewhere
            expect(page.locator(".facts dt:text-is('Runs on') + dd")).to_have_text("n[3-4]")
            fake.finish(job_id, {"ok": True})
            expect(page.locator(".job-head .badge")).to_have_text("succeeded")
            expect(rows.nth(1).locator(".badge")).to_have_text("succeeded")
            expect(rows.nth(1)).to_contain_text("n[3-4]")
            shot(page, tmp_path, "job-retried")


def test_a_job_page_shows_its_code_with_its_files_and_its_interpreter(
    browser: Browser, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    from service.code_pack import pack

    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        data_dir=tmp_path / "data",
        job_accounts="service",
        dispatch_interval_s=0.1,
    )
    proj = tmp_path / "proj"
    (proj / "model").mkdir(parents=True)
    (proj / "train.py").write_text("def main(ctx):\n    return 1\n")
    (proj / "model" / "net.py").write_text("X = 1\n")
    packed = pack(proj)
    with serve(create_app(settings, backends={"local": FakeBackend("local")})) as fresh:
        headers = bearer(token(fresh, ADMIN, admin=True))  # admins may run code
        upload = httpx.post(f"{fresh.url}/api/v1/code", content=packed.data,
                            headers={**headers, "Content-Type": "application/gzip"})  # fmt: skip
        assert upload.status_code == 201, upload.text
        python = settings.job_interpreter()
        body = {"name": "own", "code": packed.id, "entrypoint": "train:main", "python": python}
        response = httpx.post(f"{fresh.url}/api/v1/jobs", json=body, headers=headers, timeout=30)
        assert response.status_code == 201, response.text
        with open_page(browser, fresh.url, token(fresh, ADMIN, admin=True)) as page:
            page.goto(f"/#/jobs/{response.json()['id']}")
            expect(page.locator(".facts dt:text-is('Interpreter') + dd")).to_have_text(python)
            code = page.locator(".facts details.code")
            expect(code.locator("summary")).to_have_text(f"{packed.id[:19]}…")
            code.locator("summary").click()
            expect(code.locator(".code-files li")).to_have_text(["model/net.py", "train.py"])
            shot(page, tmp_path, "job-own-code")
