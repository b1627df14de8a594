"""The watchdog on the local backend: real processes, real torch, real gloo.

- Rank 1 of 3 sleeps forever in a function of the job's own module while the others wait in
  all_reduce: within the threshold (plus an activity sample, a capture and a check) the job is flagged
  stalled, the reason naming rank 1's function and line and the others together.
- Every rank deadlocked (each waits to receive from the next): flagged, with every rank's stack.
- `on_stall: "fail"` with `retries.on: ["hang"]`: the attempt ends `hang`, the retry resumes from the
  checkpoint and succeeds, bit-identical to an uninterrupted run.
- A healthy job with slow steps is never flagged; a torchrun-style script that reports nothing is
  watched as well.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.app import create_app
from service.config import Settings
from service.domain.capture import last_capture
from service.ledger.db import make_engine, session_scope
from service.states import TERMINAL_STATE_NAMES
from tests.integration.test_faults_local import assert_nothing_left, ended
from tests.serving import LiveServer, serve
from tests.support import ROOT, rank_pid, wait_for

pytestmark = pytest.mark.integration

JOBS = "/api/v1/jobs"
STALLS = ROOT / "worker/tasks/stalls.py"
SCRIPT = ROOT / "tests/data/stall_script.py"
STALL_AFTER_S = 15.0
# What a stall may take past its threshold to be flagged: the stuck rank's last activity sample (5 s
# apart), the capture (at most 3 s), the watchdog's check (every 2 s), and two cores' slack.
FLAG_SLACK_S = 5 + 3 + 2 + 3


@pytest.fixture
def live(tmp_path: Path) -> Iterator[tuple[httpx.Client, str]]:
    database_url = f"sqlite:///{tmp_path}/ledger.db"
    settings = Settings(
        job_accounts="service",
        data_dir=tmp_path / "data",
        database_url=database_url,
        local_reconcile_interval_s=0.2,
        dispatch_interval_s=0.2,
        allowed_script_dirs=[str(SCRIPT.parent)],
    )
    server: LiveServer
    with serve(create_app(settings)) as server, server.client("alice") as client:
        yield client, database_url


def submit(client: httpx.Client, name: str, **body: Any) -> int:
    response = client.post(JOBS, json={"name": name, **body})
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def job(client: httpx.Client, job_id: int) -> dict[str, Any]:
    found: dict[str, Any] = client.get(f"{JOBS}/{job_id}").raise_for_status().json()
    return found


def stalled(client: httpx.Client, job_id: int, timeout: float) -> dict[str, Any]:
    return wait_for(lambda: (j := job(client, job_id))["stalled_at"] and j, timeout, f"job {job_id} stalled")


def line_of(path: Path, text: str, after: str) -> int:
    """The number of the first line holding `text` after the line holding `after`."""
    lines = path.read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if after in line)
    return next(index for index, line in enumerate(lines) if index > start and text in line) + 1


def seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def cancel(client: httpx.Client, job_id: int) -> dict[str, Any]:
    if job(client, job_id)["state"] not in TERMINAL_STATE_NAMES:
        client.post(f"{JOBS}/{job_id}/cancel").raise_for_status()
    return ended(client, job_id, 60)


@contextmanager
def cancelled_after(client: httpx.Client, job_id: int) -> Iterator[int]:
    """The job, cancelled whatever the test found (a stuck rank must not outlive its test), and
    nothing of it left."""
    try:
        yield job_id
    finally:
        assert_nothing_left(cancel(client, job_id))


def stall_events(client: httpx.Client, job_id: int) -> list[str]:
    events = client.get(f"{JOBS}/{job_id}/events").raise_for_status().json()
    return [e["reason"] for e in events if (e["reason"] or "").startswith("stalled: ")]


def test_one_rank_stuck_in_the_jobs_own_code_is_flagged_naming_it_and_its_end_says_where_it_was(
    live: tuple[httpx.Client, str],
) -> None:
    client, _ = live
    job_id = submit(
        client, "stuck", entrypoint="worker.tasks.stalls:hang_on_rank", retries={"max": 0},
        restarts={"max": 0},  # the end of the attempt, where the stuck rank was (not a restart in place)
        resources={"tasks_per_node": 3}, watchdog={"stall_after_s": STALL_AFTER_S},
    )  # fmt: skip
    with cancelled_after(client, job_id):
        last = wait_for(lambda: (j := job(client, job_id))["progress"] and j["progress"]["step"] == 3 and j,
                        120, "the last report")  # fmt: skip

        flagged = stalled(client, job_id, 90)

        late = seconds(flagged["stalled_at"]) - last["progress"]["time"]
        reason = flagged["stall_reason"]
        print(f"\nflagged {late:.1f} s after the last report (threshold {STALL_AFTER_S:g} s): {reason}")
        assert STALL_AFTER_S <= late <= STALL_AFTER_S + FLAG_SLACK_S
        assert flagged["state"] == "running"
        line = line_of(STALLS, "time.sleep(3600)", "def sleep_forever")
        assert re.search(
            rf"^no progress for [^;]*; rank 1 on \S+ in \S*stalls\.py:{line} sleep_forever", reason
        )
        assert re.search(r"ranks 0, 2 (on \S+ )?wait in all_reduce", reason), reason
        assert stall_events(client, job_id) == [f"stalled: {reason}"]

        # The stuck rank dies: its peers lose it, and the end says where it was before.
        os.kill(rank_pid(flagged, 1), signal.SIGKILL)
        done = ended(client, job_id, 60)
        first = client.get(f"{JOBS}/{job_id}/attempts").raise_for_status().json()[0]
        assert (done["state"], first["kind"]) == ("failed", "node_failure"), first
        assert re.search(
            rf"\nbefore the end: rank 1 on \S+ in \S*stalls\.py:{line} sleep_forever", done["reason"]
        )
        assert done["stalled_at"] is None


def test_every_rank_deadlocked_is_flagged_with_every_ranks_stack(live: tuple[httpx.Client, str]) -> None:
    client, database_url = live
    job_id = submit(
        client, "deadlock", entrypoint="worker.tasks.stalls:deadlock",
        resources={"tasks_per_node": 3}, watchdog={"stall_after_s": STALL_AFTER_S},
    )  # fmt: skip

    with cancelled_after(client, job_id):
        flagged = stalled(client, job_id, 150)

        print(f"\n{flagged['stall_reason']}")
        assert re.search(r"ranks 0-2 .*stalls\.py:\d+ deadlock", flagged["stall_reason"])
        engine = make_engine(database_url)
        try:
            with session_scope(engine) as session:
                capture = last_capture(session, job_id)
        finally:
            engine.dispose()
        assert capture is not None and capture.trigger == "stall"
        assert sorted(rank.rank for rank in capture.ranks) == [0, 1, 2]
        assert all(rank.threads for rank in capture.ranks), capture


def test_a_hang_fails_the_attempt_and_the_retry_resumes_to_an_uninterrupted_result(
    live: tuple[httpx.Client, str],
) -> None:
    client, _ = live
    train = {"entrypoint": "worker.tasks.train:train", "resources": {"tasks_per_node": 2}}
    kwargs = {"epochs": 3, "samples": 256, "batch_size": 32, "seed": 3}
    hangs = submit(
        client, "hangs", **train, kwargs={**kwargs, "hang_on_attempts": [1]},
        watchdog={"stall_after_s": STALL_AFTER_S, "on_stall": "fail"},
        retries={"max": 1, "backoff_s": 1, "on": ["hang"]},
        restarts={"max": 0},  # the retry path (a restart in place of a hang: the supervisor's tests)
    )  # fmt: skip
    whole = submit(client, "whole", **train, kwargs=kwargs)

    done, reference = ended(client, hangs, 300), ended(client, whole, 300)

    assert done["state"] == "succeeded", done["reason"]
    assert reference["state"] == "succeeded", reference["reason"]
    assert done["attempt"] == 2 and done["result"]["resumed_from_epoch"] == 0
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]  # bit for bit
    first = client.get(f"{JOBS}/{hangs}/attempts").raise_for_status().json()[0]
    assert (first["state"], first["kind"]) == ("failed", "hang"), first
    line = line_of(ROOT / "worker/tasks/train.py", "time.sleep(3600)", "def hang_forever")
    assert f"train.py:{line} hang_forever" in first["reason"], first["reason"]
    assert done["stalled_at"] is None
    assert_nothing_left(done)


def test_a_healthy_job_with_slow_steps_is_never_flagged(live: tuple[httpx.Client, str]) -> None:
    client, _ = live
    job_id = submit(
        client, "slow", entrypoint="worker.tasks.stalls:slow_steps", kwargs={"steps": 3, "step_s": 20},
        resources={"tasks_per_node": 2}, watchdog={"stall_after_s": 15},  # shorter than a step
    )  # fmt: skip

    seen: set[Any] = set()
    deadline = time.monotonic() + 240
    while (current := job(client, job_id))["state"] not in ("succeeded", "failed", "cancelled", "timeout"):
        seen.add(current["stalled_at"])
        assert time.monotonic() < deadline
        time.sleep(0.5)

    assert current["state"] == "succeeded", current["reason"]
    assert seen <= {None}
    events = client.get(f"{JOBS}/{job_id}/events").raise_for_status().json()
    assert not [e for e in events if (e["reason"] or "").startswith("stalled")]


def test_a_torchrun_style_script_that_reports_nothing_is_watched(live: tuple[httpx.Client, str]) -> None:
    client, _ = live
    job_id = submit(
        client, "script", script=str(SCRIPT), resources={"tasks_per_node": 3},
        watchdog={"stall_after_s": STALL_AFTER_S},
    )  # fmt: skip

    with cancelled_after(client, job_id):
        flagged = stalled(client, job_id, 150)

        assert flagged["progress"] is None
        line = line_of(SCRIPT, "time.sleep(3600)", "def stuck_here")
        assert re.search(rf"rank 1 on \S+ in \S*stall_script\.py:{line} stuck_here", flagged["stall_reason"])


def test_a_hang_is_restarted_in_place_and_a_second_one_spends_the_restarts(
    live: tuple[httpx.Client, str],
) -> None:
    """The watchdog asks the job's supervisor to restart a hung run (restart-request.json); the run
    after it hangs again (the same attempt), no restart is left, and the attempt ends as `hang` for the
    retry, which resumes to an uninterrupted result."""
    client, _ = live
    train = {"entrypoint": "worker.tasks.train:train", "resources": {"tasks_per_node": 2}}
    kwargs = {"epochs": 3, "samples": 256, "batch_size": 32, "seed": 3}
    hangs = submit(
        client, "hangs", **train, kwargs={**kwargs, "hang_on_attempts": [1]},
        watchdog={"stall_after_s": STALL_AFTER_S, "on_stall": "fail"},
        retries={"max": 1, "backoff_s": 1, "on": ["hang"]}, restarts={"max": 1},
    )  # fmt: skip
    whole = submit(client, "whole", **train, kwargs=kwargs)

    done, reference = ended(client, hangs, 300), ended(client, whole, 300)

    folder = Path(done["folder"])
    records = [json.loads(line) for line in (folder / "restarts.jsonl").read_text().splitlines()]
    assert [(r["attempt"], r["outcome"], r["cause"]) for r in records] == [(1, "restarted", "hang")]
    assert records[0]["resumed_step"] is not None  # from the checkpoint before the hang
    first = client.get(f"{JOBS}/{hangs}/attempts").raise_for_status().json()[0]
    assert (first["state"], first["kind"]) == ("failed", "hang"), first
    assert done["state"] == "succeeded", done["reason"]
    assert done["attempt"] == 2 and done["restart_count"] == 1
    assert done["result"]["param_checksum"] == reference["result"]["param_checksum"]  # bit for bit
    assert_nothing_left(done)
