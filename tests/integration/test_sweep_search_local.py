"""A TPE search with real processes on the local backend (worker.tasks.curves: a loss whose floor the
learning rate sets), and a real kill -9 of the service mid-sweep: the restarted service makes the
rest of the trials from the ledger, none of them twice."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.ledger.db import make_engine
from tests.cli_service import clean_env
from tests.integration.test_service_local import start_service
from tests.integration.test_sweep_pruning_local import INTERVALS, finished
from tests.serving import LiveServer, free_port, serve
from tests.support import bearer, issue_token, wait_for

pytestmark = pytest.mark.integration

SWEEPS = "/api/v1/sweeps"
TRIALS = 8
SWEEP = {
    "name": "tpe",
    "job": {"entrypoint": "worker.tasks.curves:curve", "kwargs": {"steps": 5}},
    "max_parallel": 2,
    "search": {
        "method": "tpe",
        "trials": TRIALS,
        "seed": 11,
        "space": {"lr": {"log_uniform": [1e-4, 1.0]}, "step_s": {"choice": [0.05, 0.1]}},
    },
}


@pytest.fixture
def live(tmp_path: Path) -> Iterator[httpx.Client]:
    settings = Settings(
        job_accounts="service",
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path}/ledger.db",
        **INTERVALS,
    )
    server: LiveServer
    with serve(create_app(settings)) as server, server.client("alice") as client:
        yield client


def check_trials(sweep: dict[str, Any]) -> None:
    trials = sweep["trials"]
    assert sweep["size"] == len(trials) == TRIALS
    assert [trial["name"] for trial in trials] == [f"tpe[{index}]" for index in range(TRIALS)]
    for trial in trials:
        assert trial["state"] == "succeeded", trial
        assert 1e-4 <= trial["params"]["lr"] <= 1.0 and trial["params"]["step_s"] in (0.05, 0.1), trial
    assert sweep["best"]["metric_last"] == min(trial["metric_last"] for trial in trials)


def test_a_tpe_search_makes_its_trials_inside_their_space(live: httpx.Client) -> None:
    response = live.post(SWEEPS, json=SWEEP)
    assert response.status_code == 201, response.text
    assert response.json()["size"] == 2
    check_trials(finished(live, response.json()["id"], timeout=240))


def test_a_service_killed_mid_search_makes_no_trial_twice(tmp_path: Path) -> None:
    ledger = f"sqlite:///{tmp_path}/ledger.db"
    env = clean_env(
        TORCHYARD_DATA_DIR=str(tmp_path / "data"),
        TORCHYARD_DATABASE_URL=ledger,
        TORCHYARD_LOCAL_RECONCILE_INTERVAL_S="0.2",
        TORCHYARD_DISPATCH_INTERVAL_S="0.2",
    )
    port = free_port()
    first = start_service(env, port)
    engine = make_engine(ledger)
    try:
        headers = bearer(issue_token(engine, "alice"))
    finally:
        engine.dispose()
    second: subprocess.Popen[bytes] | None = None
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=30) as client:
        try:
            response = client.post(SWEEPS, json=SWEEP)
            assert response.status_code == 201, response.text
            sweep_id = response.json()["id"]
            # Past the first wave: the search loop has made trials, and has more to make.
            made = lambda: 3 <= client.get(f"{SWEEPS}/{sweep_id}").json()["size"] < TRIALS  # noqa: E731
            wait_for(made, 180, "trials made")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        time.sleep(1)  # the trials under way run on, unwatched
        try:
            second = start_service(env, port)
            sweep = finished(client, sweep_id, timeout=240)
            check_trials(sweep)
            for trial in sweep["trials"]:  # no trial ran twice
                events = client.get(f"/api/v1/jobs/{trial['job_id']}/events").json()
                states = [event["to_state"] for event in events]
                assert states.count("submitted") <= 1, states
        finally:
            if second is not None:
                second.terminate()
                second.wait(timeout=30)
