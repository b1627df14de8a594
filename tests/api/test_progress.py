"""Rank 0's progress file -> the ledger (metrics, latest progress, latest checkpoint), via reconcile.

The lines are written by hand here, in the format worker.context writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from tests.support import JOBS, get_job, runtime_of, submit, wait_for, wait_state

T0 = 1_700_000_000.0


def progress_file(job: dict[str, Any]) -> Path:
    return Path(job["folder"]) / "progress.jsonl"


def append(path: Path, *lines: dict[str, Any] | str) -> None:
    with path.open("a") as handle:
        for line in lines:
            handle.write(line if isinstance(line, str) else json.dumps(line) + "\n")


def step(n: int, total: int = 10, attempt: int = 1, **metrics: float) -> dict[str, Any]:
    return {"step": n, "total": total, "metrics": metrics, "time": T0 + n, "attempt": attempt}


def metrics(api: TestClient, job_id: int, **params: Any) -> list[dict[str, Any]]:
    response = api.get(f"{JOBS}/{job_id}/metrics", params=params)
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()
    return rows


def wait_metrics(api: TestClient, job_id: int, count: int) -> list[dict[str, Any]]:
    def probe() -> list[dict[str, Any]] | None:
        rows = metrics(api, job_id)
        return rows if len(rows) >= count else None

    return wait_for(probe, what=f"{count} metric rows")


def test_progress_lines_become_metrics_progress_and_checkpoint(api: TestClient) -> None:
    job = wait_state(api, submit(api)["id"], "running")
    append(
        progress_file(job),
        step(1, loss=0.5, accuracy=0.2),
        step(2, loss=0.25, accuracy=0.4),
        {"checkpoint": "/data/ckpt-00000002.pt", "step": 2, "time": T0 + 2.5, "attempt": 1},
        step(3, loss=0.125, accuracy=0.6),
    )

    rows = wait_metrics(api, job["id"], 6)

    assert [(r["step"], r["name"], r["value"]) for r in rows] == [
        (1, "loss", 0.5),
        (1, "accuracy", 0.2),
        (2, "loss", 0.25),
        (2, "accuracy", 0.4),
        (3, "loss", 0.125),
        (3, "accuracy", 0.6),
    ]
    assert rows[0]["time"].startswith("2023-11-14T22:13:21")  # the line's own time, not the reader's
    assert {r["attempt"] for r in rows} == {1}
    now = get_job(api, job["id"])
    assert now["progress"] == {
        "step": 3,
        "total": 10,
        "metrics": {"loss": 0.125, "accuracy": 0.6},
        "time": T0 + 3,
        "attempt": 1,
    }
    assert now["latest_checkpoint"] == "/data/ckpt-00000002.pt"


def test_metrics_can_be_filtered_by_name_and_step(api: TestClient) -> None:
    job = wait_state(api, submit(api)["id"], "running")
    append(progress_file(job), *(step(n, loss=1 / n, lr=0.1) for n in range(1, 6)))
    wait_metrics(api, job["id"], 10)

    losses = metrics(api, job["id"], name="loss")
    late = metrics(api, job["id"], name="lr", after_step=3)

    assert [r["step"] for r in losses] == [1, 2, 3, 4, 5] and {r["name"] for r in losses} == {"loss"}
    assert [(r["step"], r["name"]) for r in late] == [(4, "lr"), (5, "lr")]


def test_a_half_written_line_waits_for_its_end_and_nothing_is_read_twice(api: TestClient) -> None:
    job = wait_state(api, submit(api)["id"], "running")
    path = progress_file(job)
    text = json.dumps(step(2, loss=0.2))
    append(path, step(1, loss=0.1), text[:10])  # rank 0 is mid-write
    wait_metrics(api, job["id"], 1)
    reconciler = runtime_of(api).reconciler
    ticks = reconciler.ticks["local"]
    wait_for(lambda: reconciler.ticks["local"] >= ticks + 3, what="three more reconcile ticks")
    assert len(metrics(api, job["id"])) == 1

    append(path, text[10:] + "\n")

    rows = wait_metrics(api, job["id"], 2)
    wait_for(lambda: reconciler.ticks["local"] >= ticks + 6, what="three more reconcile ticks")
    assert (
        [(r["step"], r["value"]) for r in metrics(api, job["id"])]
        == [(1, 0.1), (2, 0.2)]
        == [(r["step"], r["value"]) for r in rows]
    )


def test_bad_lines_are_skipped_and_never_stall_the_loop(api: TestClient) -> None:
    """A line the reader cannot use must cost that line only, not every job's reconciliation."""
    job = wait_state(api, submit(api, name="messy")["id"], "running")
    other = wait_state(api, submit(api, name="other")["id"], "running")
    append(
        progress_file(job),
        "this is not json\n",
        "[1, 2, 3]\n",
        {"step": None, "metrics": {"loss": 1.0}},
        {"step": "seven", "metrics": {"loss": 1.0}},
        {"step": 2**40, "metrics": {"loss": 1.0}},
        {"step": 1, "metrics": {"loss": 1.0}, "time": 1e300},
        {"step": 2, "metrics": {"loss": "low", "nested": {"a": 1}, "ok": 0.5}, "time": T0},
        '{"step": 3, "metrics": {"loss": NaN, "acc": Infinity, "ok": 0.25}, "time": 1700000003.0}\n',
        {"step": 3, "metrics": {"huge": 10**400, "nul\x00name": 1.0}, "attempt": "first"},
        {"checkpoint": "/bad\x00path"},
        {"checkpoint": 17},
        step(4, loss=0.1),
    )

    rows = wait_metrics(api, job["id"], 4)

    assert [(r["step"], r["name"], r["value"]) for r in rows] == [
        (1, "loss", 1.0),
        (2, "ok", 0.5),
        (3, "ok", 0.25),
        (4, "loss", 0.1),
    ]
    assert get_job(api, job["id"])["progress"]["step"] == 4
    assert get_job(api, job["id"])["latest_checkpoint"] is None
    append(progress_file(other), step(1, loss=0.3))
    assert wait_metrics(api, other["id"], 1)[0]["value"] == 0.3


def test_the_latest_progress_never_stores_a_number_json_cannot_hold(api: TestClient) -> None:
    job = wait_state(api, submit(api)["id"], "running")
    append(progress_file(job), '{"step": 1, "total": 5, "metrics": {"loss": NaN}, "time": 1700000001.0}\n')

    wait_for(lambda: (get_job(api, job["id"])["progress"] or {}).get("step") == 1, what="progress")

    assert get_job(api, job["id"])["progress"]["metrics"] == {"loss": None}
    assert metrics(api, job["id"]) == []
