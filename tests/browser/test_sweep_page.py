"""The sweep page in real Chromium: every trial's curve on one uPlot chart, updating while the trials
run, a legend naming each trial's parameters, and a table of trials that sorts by any column."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page

from tests.browser.conftest import shot, token
from tests.serving import LiveServer
from tests.support import bearer, wait_for

pytestmark = pytest.mark.browser


def launch(service: LiveServer) -> dict[str, Any]:
    body = {
        "name": "lr-bs",
        "job": {
            "entrypoint": "worker.tasks.train:train",
            "kwargs": {"epochs": 4, "samples": 64, "report_every": 1, "sleep_per_step": 0.15},
        },
        "grid": {"lr": [0.01, 0.1], "batch_size": [8, 16, 32]},
    }
    response = httpx.post(f"{service.url}/api/v1/sweeps", json=body, headers=bearer(token(service)))
    assert response.status_code == 201, response.text
    sweep: dict[str, Any] = response.json()
    return sweep


def read(service: LiveServer, sweep_id: int) -> dict[str, Any]:
    response = httpx.get(f"{service.url}/api/v1/sweeps/{sweep_id}", headers=bearer(token(service)))
    sweep: dict[str, Any] = response.raise_for_status().json()
    return sweep


def test_six_curves_update_live_and_the_table_sorts(page: Page, service: LiveServer, tmp_path: Path) -> None:
    sweep = launch(service)
    page.goto(f"/#/sweeps/{sweep['id']}")
    chart = page.locator(".sweep-chart")
    wait_for(lambda: chart.get_attribute("data-trials") == "6", 30, "the chart of six trials")
    legend = page.locator(".sweep-chart .u-legend .u-series")
    assert legend.count() == 7  # the step axis and six trials
    labels = [legend.nth(i).text_content() or "" for i in range(1, 7)]
    for trial in sweep["trials"]:
        assert any(f"lr={trial['params']['lr']} batch_size={trial['params']['batch_size']}" in label
                   for label in labels), labels  # fmt: skip

    # Points arrive while the trials run: the chart grows without a reload.
    def points() -> int:
        return int(chart.get_attribute("data-points") or 0)

    wait_for(lambda: points() > 0, 120, "a first point on the chart")
    seen = points()
    wait_for(lambda: points() > seen and read(service, sweep["id"])["state"] == "active", 120,
             "more points while trials still run")  # fmt: skip
    shot(page, tmp_path, "sweep-running")

    wait_for(lambda: read(service, sweep["id"])["state"] == "finished", 300, "every trial to end")
    final = read(service, sweep["id"])
    assert final["counts"] == {"succeeded": 6}
    # One point per step of each trial (a step reported twice is drawn once, with its later value).
    expected_points = sum(len({p["step"] for p in _metric(service, t["job_id"])}) for t in final["trials"])
    wait_for(lambda: points() == expected_points, 30, f"all {expected_points} points drawn")
    canvas = page.locator(".sweep-chart canvas")
    assert canvas.count() == 1 and canvas.bounding_box()["width"] > 300  # type: ignore[index]

    # The table: sorted by the best loss first, then by any column the user clicks, both ways.
    def column(index: int) -> list[str]:
        cells: list[str] = page.locator(".trials tbody tr").evaluate_all(
            f"rows => rows.map(r => r.children[{index}].textContent.trim())"
        )
        return cells

    def job_ids() -> list[int]:
        return [int(cell.lstrip("#")) for cell in column(0)]

    wait_for(lambda: page.locator(".trials tbody tr").count() == 6, 10, "six rows")
    by_best = sorted(final["trials"], key=lambda t: t["metric_best"])
    wait_for(lambda: job_ids() == [t["job_id"] for t in by_best], 10, "rows by best loss")
    page.locator(".trials th[data-key=metric_last]").click()
    assert job_ids() == [t["job_id"] for t in sorted(final["trials"], key=lambda t: t["metric_last"])]
    page.locator(".trials th[data-key=metric_last]").click()
    assert job_ids() == [t["job_id"] for t in sorted(final["trials"], key=lambda t: -t["metric_last"])]
    page.locator(".trials th[data-key=job_id]").click()
    assert job_ids() == sorted(t["job_id"] for t in final["trials"])
    assert page.locator(".trials tr.best-trial td a").inner_text() == f"#{final['best']['job_id']}"
    shot(page, tmp_path, "sweep-finished")

    page.locator(f".trials a[href='#/jobs/{final['best']['job_id']}']").click()  # each trial links to its job
    page.wait_for_url(f"**/#/jobs/{final['best']['job_id']}")
    sweep_link = page.locator(f".facts a[href='#/sweeps/{sweep['id']}']")  # and the job back to its sweep
    sweep_link.wait_for()
    assert "lr=" in (sweep_link.locator("xpath=..").text_content() or "")

    page.goto("/#/sweeps")
    row = page.locator(".sweeps tbody tr").first
    row.wait_for()
    assert "lr-bs" in row.inner_text() and "6 succeeded" in row.inner_text()


def _metric(service: LiveServer, job_id: int) -> list[dict[str, Any]]:
    response = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics", params={"name": "loss"},
                         headers=bearer(token(service)))  # fmt: skip
    points: list[dict[str, Any]] = response.raise_for_status().json()
    return points


def test_trials_waiting_their_turn_are_not_asked_for_points(page: Page, service: LiveServer) -> None:
    body = {
        "name": "one-at-a-time",
        "job": {
            "entrypoint": "worker.tasks.train:train",
            "kwargs": {"epochs": 2, "samples": 32, "report_every": 1, "sleep_per_step": 0.2},
        },
        "grid": {"lr": [0.01, 0.02, 0.03, 0.04, 0.05, 0.06]},
        "max_parallel": 1,
    }
    response = httpx.post(f"{service.url}/api/v1/sweeps", json=body, headers=bearer(token(service)))
    assert response.status_code == 201, response.text
    sweep = response.json()
    asked: list[str] = []
    page.on("request", lambda request: asked.append(request.url) if "/metrics" in request.url else None)
    page.goto(f"/#/sweeps/{sweep['id']}")
    chart = page.locator(".sweep-chart")
    wait_for(lambda: int(chart.get_attribute("data-points") or 0) > 2, 120, "the first trial's points")

    now = read(service, sweep["id"])
    without_points = {t["job_id"] for t in now["trials"] if t["metric_last"] is None}
    assert len(without_points) >= 4  # one at a time: most are still waiting their turn
    assert asked and not [url for url in asked if any(f"/jobs/{i}/metrics" in url for i in without_points)]
