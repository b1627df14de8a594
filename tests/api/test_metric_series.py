"""GET /jobs/{id}/metrics?points=N: each series in at most N points that keep its spikes, from the
rollup (service.domain.metric_series), in bounded time for a million points per metric."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import bindparam, select, text
from sqlalchemy.engine import Engine

from service.domain.metric_series import SeriesKey, refresh
from service.ledger.db import write_scope
from service.ledger.models.columns import UTCDateTime, utcnow
from service.ledger.models.jobs import Job
from service.ledger.models.metrics import JobMetric, JobMetricRollup
from service.loops.progress import ingest_progress
from tests.support import JOBS, runtime_of, submit

MILLION = 1_000_000
SPIKE_STEP, SPIKE = 654_321, 50.0
DIP_STEP, DIP = 123_457, -5.0


def _engine(api: TestClient) -> Engine:
    return runtime_of(api).engine


def _insert(
    engine: Engine, job_id: int, name: str, points: list[tuple[int, float]], attempt: int = 1
) -> None:
    rows = [
        {"job_id": job_id, "step": s, "name": name, "value": v, "attempt": attempt, "time": utcnow()}
        for s, v in points
    ]
    with engine.begin() as connection:
        connection.execute(JobMetric.__table__.insert(), rows)  # type: ignore[attr-defined]
        steps = [s for s, _ in points]
        refresh(connection, SeriesKey(job_id, name, attempt), min(steps), max(steps))


def _series(api: TestClient, job_id: int, **params: Any) -> dict[str, Any]:
    response = api.get(f"{JOBS}/{job_id}/metrics", params=params)
    assert response.status_code == 200, response.text
    page: dict[str, Any] = response.json()
    return page


def _one(page: dict[str, Any], name: str, attempt: int = 1) -> tuple[list[int], list[float], bool]:
    [found] = [s for s in page["series"] if (s["name"], s["attempt"]) == (name, attempt)]
    return found["steps"], found["values"], found["downsampled"]


def test_a_short_series_comes_back_whole(api: TestClient) -> None:
    job_id = submit(api)["id"]
    points = [(step, float(step) / 10) for step in range(0, 60, 3)]
    _insert(_engine(api), job_id, "loss", points)
    _insert(_engine(api), job_id, "loss", [(0, 9.0), (3, 8.0)], attempt=2)  # a resumed attempt: its own

    page = _series(api, job_id, points=100)

    assert [(s["name"], s["attempt"]) for s in page["series"]] == [("loss", 1), ("loss", 2)]
    steps, values, downsampled = _one(page, "loss")
    assert list(zip(steps, values, strict=True)) == points and downsampled is False
    assert _one(page, "loss", attempt=2)[:2] == ([0, 3], [9.0, 8.0])


def test_downsampling_keeps_first_last_and_every_extreme(api: TestClient) -> None:
    job_id = submit(api)["id"]
    chance = random.Random(20)
    raw = [(step, chance.gauss(0, 1)) for step in range(0, 50_000, 7)]
    _insert(_engine(api), job_id, "loss", raw)
    every = dict(raw)

    steps, values, downsampled = _one(_series(api, job_id, points=200), "loss")

    assert downsampled and len(steps) <= 200 and steps == sorted(steps)
    assert all(every[s] == v for s, v in zip(steps, values, strict=True))  # real points only
    assert steps[0] == raw[0][0] and steps[-1] == raw[-1][0]
    assert min(values) == min(v for _, v in raw) and max(values) == max(v for _, v in raw)
    # A point that is the lowest or highest within two slices' width (a slice: 1/50 of the range) on
    # either side holds its slice, whatever the slices' edges: it must be shown.
    shown = set(zip(steps, values, strict=True))
    reach = 2 * 50_000 // 50
    for index, (step, value) in enumerate(raw):
        near = [v for _, v in raw[max(0, index - reach // 7) : index + reach // 7 + 1]]
        if value in (min(near), max(near)):
            assert (step, value) in shown


def test_zooming_in_refines_down_to_every_point(api: TestClient) -> None:
    job_id = submit(api)["id"]
    raw = [(step, float((step * 7919) % 1000)) for step in range(100_000)]
    _insert(_engine(api), job_id, "loss", raw)

    wide = _series(api, job_id, points=400, from_step=20_000, to_step=29_999)
    steps, values, downsampled = _one(wide, "loss")
    assert downsampled and len(steps) <= 400 and steps[0] >= 20_000 and steps[-1] <= 29_999
    assert max(values) == 999.0 and min(values) == 0.0

    close = _series(api, job_id, points=400, from_step=20_000, to_step=20_299)
    steps, values, downsampled = _one(close, "loss")
    assert not downsampled and list(zip(steps, values, strict=True)) == raw[20_000:20_300]


def test_the_rollup_kept_while_ingesting_equals_one_built_at_once(api: TestClient, tmp_path: Path) -> None:
    engine = _engine(api)
    job_id = submit(api)["id"]
    progress = tmp_path / "progress.jsonl"
    chance = random.Random(5)
    step = 0
    for _ in range(30):  # reconcile ticks, each reading the lines written since the last
        with progress.open("a") as out:
            for _ in range(chance.randrange(1, 200)):
                step += chance.randrange(1, 40)
                metrics = {"loss": chance.random(), "lr": 0.1}
                out.write(json.dumps({"step": step, "metrics": metrics, "attempt": 1}) + "\n")
        with write_scope(engine) as session:
            job = session.get(Job, job_id)
            assert job is not None
            ingest_progress(session, job, progress)
    kept = _rollup(engine, job_id)

    with engine.begin() as connection:
        connection.execute(JobMetricRollup.__table__.delete())  # type: ignore[attr-defined]
        for name in ("loss", "lr"):
            refresh(connection, SeriesKey(job_id, name, 1), 0, step)

    assert kept == _rollup(engine, job_id) and len(kept) > 100


def _rollup(engine: Engine, job_id: int) -> list[tuple[Any, ...]]:
    r = JobMetricRollup.__table__  # type: ignore[attr-defined]
    query = select(*(c for c in r.c if c.name != "id")).where(r.c.job_id == job_id)
    with engine.connect() as connection:
        return sorted(tuple(row) for row in connection.execute(query))


def test_bad_ranges_name_their_field(api: TestClient) -> None:
    job_id = submit(api)["id"]
    wrong = api.get(f"{JOBS}/{job_id}/metrics", params={"points": 100, "from_step": 9, "to_step": 3})
    alone = api.get(f"{JOBS}/{job_id}/metrics", params={"from_step": 9})
    few = api.get(f"{JOBS}/{job_id}/metrics", params={"points": 1})

    assert wrong.status_code == 422 and wrong.json()["detail"][0]["loc"][-1] == "to_step"
    assert alone.status_code == 422 and alone.json()["detail"][0]["loc"][-1] == "points"
    assert few.status_code == 422 and few.json()["detail"][0]["loc"][-1] == "points"


# ---------------------------------------------------------------- a million points per metric


def _bulk_insert(engine: Engine, job_id: int, name: str, value_sql: str) -> None:
    """A million rows in one statement, made by the database (not via the API: that would take hours)."""
    numbers = (
        "WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i < :last) "
        if engine.dialect.name == "sqlite"
        else ""
    )
    source = "s" if engine.dialect.name == "sqlite" else "generate_series(0, :last) AS s(i)"
    statement = text(
        f"{numbers}INSERT INTO jobmetric (job_id, step, name, value, attempt, time) "
        f"SELECT :job_id, i, :name, {value_sql}, 1, :time FROM {source}"
    ).bindparams(bindparam("time", type_=UTCDateTime))
    with engine.begin() as connection:
        connection.execute(statement, {"job_id": job_id, "name": name, "last": MILLION - 1, "time": utcnow()})
        refresh(connection, SeriesKey(job_id, name, 1), 0, MILLION - 1)


@pytest.fixture
def emptied_after(api: TestClient) -> Iterator[None]:
    """The shared PostgreSQL ledger is emptied row by row before each test: two million rows left
    behind would cost the next test more than this TRUNCATE does."""
    yield
    engine = _engine(api)
    if engine.dialect.name == "postgresql":
        with engine.begin() as connection:
            connection.execute(text("TRUNCATE jobmetric, jobmetricrollup"))


@pytest.mark.usefixtures("emptied_after")
def test_a_million_points_per_metric_load_small_and_fast(api: TestClient) -> None:
    engine = _engine(api)
    job_id = submit(api)["id"]
    loss = (
        f"CASE WHEN i = {SPIKE_STEP} THEN {SPIKE} WHEN i = {DIP_STEP} THEN {DIP} "
        "ELSE 1.0 + (i % 1000) / 1000.0 END"
    )
    _bulk_insert(engine, job_id, "loss", loss)
    _bulk_insert(engine, job_id, "lr", "0.1 - i * 0.0000001")

    took = []
    for _ in range(3):
        began = time.perf_counter()
        response = api.get(f"{JOBS}/{job_id}/metrics", params={"points": 1200})  # a wide chart's pixels
        took.append(time.perf_counter() - began)
        assert response.status_code == 200
    print(
        f"\n1M points x 2 metrics, points=1200 on {engine.dialect.name}: {len(response.content)} bytes, "
        f"{', '.join(f'{t * 1000:.1f}' for t in took)} ms"
    )

    assert len(response.content) < 100_000
    assert took[0] < 0.1 or min(took) < 0.1  # the first, unless the shared machine was busy right then
    page = response.json()
    steps, values, downsampled = _one(page, "loss")
    assert downsampled and len(steps) <= 1200 and steps[0] == 0 and steps[-1] == MILLION - 1
    assert (SPIKE_STEP, SPIKE) in zip(steps, values, strict=True)
    assert (DIP_STEP, DIP) in zip(steps, values, strict=True)
    lr_steps, _, _ = _one(page, "lr")
    assert len(lr_steps) <= 1200

    zoomed = _series(api, job_id, points=1200, from_step=SPIKE_STEP - 500, to_step=SPIKE_STEP + 499)
    steps, values, downsampled = _one(zoomed, "loss")
    assert not downsampled and len(steps) == 1000 and values[500] == SPIKE
