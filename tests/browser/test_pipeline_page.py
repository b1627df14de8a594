"""The pipeline page in real Chromium: a three-stage pipeline drawn as boxes with arrows, each box
coloured by its stage's state as the stages run one after another, and linked to its job; a job of a
pipeline links back to it; a waiting job says what it waits for, the jobs named there linked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Page

from tests.browser.conftest import shot, submit, token
from tests.serving import LiveServer
from tests.support import bearer, wait_for

pytestmark = pytest.mark.browser

SLEEP = "worker.tasks.faults:sleep"


def sleep(seconds: float) -> dict[str, Any]:
    return {"entrypoint": SLEEP, "kwargs": {"seconds": seconds}}


def launch(service: LiveServer) -> dict[str, Any]:
    """prep, then train, then eval (after both: an arrow that skips a column)."""
    body = {
        "name": "prep-train-eval",
        "stages": [
            {"name": "prep", "job": sleep(3)},
            {"name": "train", "job": sleep(8), "after": ["prep"]},
            {"name": "eval", "job": sleep(1), "after": ["prep", "train"]},
        ],
    }
    response = httpx.post(f"{service.url}/api/v1/pipelines", json=body, headers=bearer(token(service)))
    assert response.status_code == 201, response.text
    pipeline: dict[str, Any] = response.json()
    return pipeline


def read(service: LiveServer, pipeline_id: int) -> dict[str, Any]:
    response = httpx.get(f"{service.url}/api/v1/pipelines/{pipeline_id}", headers=bearer(token(service)))
    pipeline: dict[str, Any] = response.raise_for_status().json()
    return pipeline


def drawn(page: Page) -> dict[str, str]:
    """Each box on the page: stage name -> the state it is drawn in."""
    states: dict[str, str] = page.locator(".pipeline-graph .stage").evaluate_all(
        "boxes => Object.fromEntries(boxes.map(b => [b.dataset.stage, b.dataset.state]))"
    )
    return states


def box_colour_matches_badge(page: Page, stage: str) -> bool:
    """The box is outlined in the colour the dashboard gives its state everywhere (the stage's badge)."""
    same: bool = page.evaluate(
        """stage => {
            const rect = document.querySelector(`.pipeline-graph .stage[data-stage="${stage}"] rect`);
            const badge = document.querySelector(`.stages tr[data-stage="${stage}"] .badge`);
            return getComputedStyle(rect).stroke === getComputedStyle(badge).color;
        }""",
        stage,
    )
    return same


def test_three_stages_drawn_with_arrows_follow_their_states(
    page: Page, service: LiveServer, tmp_path: Path
) -> None:
    pipeline = launch(service)
    jobs = {stage["name"]: stage["job_id"] for stage in pipeline["stages"]}
    page.goto(f"/#/pipelines/{pipeline['id']}")
    boxes = page.locator(".pipeline-graph .stage")
    wait_for(lambda: boxes.count() == 3, 30, "three boxes")
    arrows = page.locator(".pipeline-graph path.arrow")
    assert arrows.count() == 3
    pairs = arrows.evaluate_all("paths => paths.map(p => [p.dataset.from, p.dataset.to])")
    assert sorted(map(tuple, pairs)) == [("prep", "eval"), ("prep", "train"), ("train", "eval")]
    assert page.locator(".pipeline-head h1").inner_text() == "prep-train-eval"
    assert page.locator(".pipeline-head").get_by_text("owner alice").count() == 1

    # Columns by depth: prep, then train, then eval, left to right.
    xs = {name: page.locator(f".stage[data-stage={name}] rect").get_attribute("x") for name in jobs}
    assert float(xs["prep"] or 0) < float(xs["train"] or 0) < float(xs["eval"] or 0)

    # Each box links to its job.
    for name, job_id in jobs.items():
        link = page.locator(f".pipeline-graph a[href='#/jobs/{job_id}']")
        assert link.locator(f".stage[data-stage={name}]").count() == 1

    # The later stages wait while prep runs; then prep has succeeded, train runs and eval still waits.
    assert drawn(page)["eval"] == "waiting"
    assert page.locator(".stage[data-stage=eval]").get_attribute("class") == "stage state-waiting"
    assert box_colour_matches_badge(page, "eval")
    wait_for(lambda: drawn(page) == {"prep": "succeeded", "train": "running", "eval": "waiting"}, 120,
             "prep succeeded, train running, eval waiting")  # fmt: skip
    assert box_colour_matches_badge(page, "prep") and box_colour_matches_badge(page, "train")
    rects = {name: page.locator(f".stage[data-stage={name}] rect") for name in jobs}
    colours = {name: rect.evaluate("r => getComputedStyle(r).stroke") for name, rect in rects.items()}
    assert len(set(colours.values())) == 3, colours  # three states, three colours
    assert "waiting" in (page.locator(".stage[data-stage=eval] title").text_content() or "")
    shot(page, tmp_path, "pipeline-running")

    wait_for(lambda: read(service, pipeline["id"])["state"] == "succeeded", 120, "the pipeline to succeed")
    wait_for(lambda: set(drawn(page).values()) == {"succeeded"}, 10, "every box succeeded")
    page.locator(".pipeline-head .badge[data-state=succeeded]").wait_for()
    assert page.locator(".pipeline-head").get_by_text("finished").count() == 1
    shot(page, tmp_path, "pipeline-succeeded")

    # A box opens its job; the job names its stage and links back to the pipeline.
    page.locator(".pipeline-graph .stage[data-stage=train]").click()
    page.wait_for_url(f"**/#/jobs/{jobs['train']}")
    back = page.locator(f".facts .pipeline-ref a[href='#/pipelines/{pipeline['id']}']")
    back.wait_for()
    assert page.locator(".facts .pipeline-ref").inner_text() == f"stage train of pipeline #{pipeline['id']}"
    back.click()
    page.wait_for_url(f"**/#/pipelines/{pipeline['id']}")
    wait_for(lambda: boxes.count() == 3, 10, "the pipeline again")

    page.goto("/#/pipelines")
    row = page.locator(f".pipelines tr[data-pipeline='{pipeline['id']}']")
    row.wait_for()
    assert "prep-train-eval" in row.inner_text() and "succeeded" in row.inner_text()
    page.goto("/#/pipelines/999999")
    page.get_by_role("heading", name="Pipeline 999999 not found").wait_for()


def test_a_waiting_job_says_what_it_waits_for_and_links_it(page: Page, service: LiveServer) -> None:
    upstream = submit(service, "upstream", SLEEP, seconds=300)
    body = {"name": "downstream", "entrypoint": SLEEP, "kwargs": {"seconds": 1}, "after": [{"job": upstream}]}
    response = httpx.post(f"{service.url}/api/v1/jobs", json=body, headers=bearer(token(service)))
    assert response.status_code == 201, response.text
    downstream = response.json()["id"]

    page.goto(f"/#/jobs/{downstream}")
    box = page.locator(".reason-box.reason-waiting")
    box.wait_for()
    assert f"waiting for job {upstream} to succeed" in box.inner_text()
    assert page.locator(".job-head .badge[data-state=waiting]").count() == 1

    # Its upstream cancelled, it is cancelled too, and the reason still links the job to blame.
    cancel = httpx.post(f"{service.url}/api/v1/jobs/{upstream}/cancel", headers=bearer(token(service)))
    assert cancel.status_code == 200, cancel.text
    page.locator(".reason-box.reason-cancelled").wait_for(timeout=30_000)
    link = page.locator(f".reason-box a[href='#/jobs/{upstream}']")
    assert link.inner_text() == f"job {upstream}"
    link.click()
    page.wait_for_url(f"**/#/jobs/{upstream}")
    page.locator(".job-head h1", has_text="upstream").wait_for()
