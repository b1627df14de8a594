"""A sweep's early stopping with real processes on the local backend, and a real kill -9 of the
service mid-sweep.

The trials are worker.tasks.curves: no training, a loss whose floor the learning rate sets, one step a
tenth of a second. max_parallel 1 runs them one after another, so the order in which they reach each
rung is the trials' order, and the decisions are known in advance (the rule's unit test works them
out: tests/unit/service/test_sweep_pruning.py).
"""

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
from tests.serving import LiveServer, free_port, serve
from tests.support import bearer, issue_token, wait_for

pytestmark = pytest.mark.integration

SWEEPS = "/api/v1/sweeps"
LRS = [0.1, 0.01, 0.3, 0.004, 0.05, 1.0, 0.0003, 0.02, 0.6]  # loss floor |log10(lr / 0.01)|: [1] is best
SWEEP = {
    "name": "curves",
    "job": {"entrypoint": "worker.tasks.curves:curve", "kwargs": {"steps": 90, "step_s": 0.1}},
    "grid": {"lr": LRS},
    "max_parallel": 1,
    "early_stop": {"method": "asha", "min_steps": 10, "reduction_factor": 3, "max_steps": 90},
}
# Trial index -> the rung it is stopped at: the first two reach each rung first and go on (ASHA judges
# the first arrivals against few); of the rest only lr 0.02 is in the top third at step 10.
PRUNED = {2: 0, 3: 0, 4: 0, 5: 0, 6: 0, 8: 0, 7: 1}
INTERVALS = {"local_reconcile_interval_s": 0.2, "dispatch_interval_s": 0.2}


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


def finished(client: httpx.Client, sweep_id: int, timeout: float = 300) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        sweep: dict[str, Any] = client.get(f"{SWEEPS}/{sweep_id}").json()
        return sweep if sweep["state"] == "finished" else None

    return wait_for(probe, timeout, f"sweep {sweep_id} to finish")


def check_decisions(sweep: dict[str, Any]) -> None:
    trials = sweep["trials"]
    stopped = {index: trial for index, trial in enumerate(trials) if trial["ending"] == "pruned"}
    assert {index: int(trial["reason"].split()[3]) for index, trial in stopped.items()} == PRUNED, [
        (trial["state"], trial["reason"]) for trial in trials
    ]
    for index, trial in enumerate(trials):
        if index in PRUNED:
            assert trial["state"] == "cancelled"
            assert trial["reason"].startswith(
                f"pruned at rung {PRUNED[index]} (step {10 * 3 ** PRUNED[index]}):"
            )
        else:
            assert (trial["state"], trial["steps"]) == ("succeeded", 90), trial
    assert sweep["best"]["params"] == {"lr": 0.01}  # the best ran to its end
    assert len(stopped) >= len(trials) / 2
    compute = sweep["compute"]
    assert compute["steps_full"] == 90 * len(trials)
    assert compute["steps_run"] <= 0.6 * compute["steps_full"], compute


def test_asha_stops_the_losers_early_and_keeps_the_best(live: httpx.Client) -> None:
    response = live.post(SWEEPS, json=SWEEP)
    assert response.status_code == 201, response.text
    sweep = finished(live, response.json()["id"])
    check_decisions(sweep)
    for trial in sweep["trials"]:  # a stopped trial was stopped near its rung, not left to run on
        if trial["ending"] == "pruned":
            assert trial["steps"] < 10 * 3 ** PRUNED[sweep["trials"].index(trial)] + 30, trial


def test_the_same_decisions_after_the_service_is_killed_mid_sweep(tmp_path: Path) -> None:
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

            def some_pruned() -> bool:
                trials = client.get(f"{SWEEPS}/{sweep_id}").json()["trials"]
                return sum(trial["ending"] == "pruned" for trial in trials) >= 2

            wait_for(some_pruned, 180, "two trials pruned")
        finally:
            first.send_signal(signal.SIGKILL)
            first.wait()
        time.sleep(1)  # the trial under way runs on, unwatched
        try:
            second = start_service(env, port)
            sweep = finished(client, sweep_id)
            check_decisions(sweep)
            for trial in sweep["trials"]:  # no trial ran twice
                events = client.get(f"/api/v1/jobs/{trial['job_id']}/events").json()
                states = [event["to_state"] for event in events]
                assert states.count("submitted") <= 1, states
        finally:
            if second is not None:
                second.terminate()
                second.wait(timeout=30)
