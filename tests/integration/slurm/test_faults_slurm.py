"""Faults injected into a real service (a subprocess) on the real cluster: a SIGKILL with jobs in flight on
both backends, and a slurmctld outage with jobs running. What must survive: every job ends in the state
its entrypoint earns, each one exactly once, and the scheduler sees each job submitted exactly once.

Ground truth for "submitted once" comes from outside the ledger: SLURM's accounting (sacct, every job
whose working directory is this test's own service cwd) and submitit's `<id>_submitted.pkl` in each job
folder (one per submission, for local jobs too).
"""

from __future__ import annotations

import itertools
import re
import shutil
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.integration.slurm.conftest import (
    Api,
    ServiceProcess,
    check_history,
    ledger_token,
    sacct_jobs,
    scancel,
    service_env,
    slurm_now,
    submissions,
)
from tests.support import ROOT, wait_for

pytestmark = pytest.mark.slurm

CONTROLLER = ROOT / "deploy" / "slurm" / "controller.sh"
OUTAGE_S = 20  # each squeue/sbatch against a stopped controller takes about 9 s to give up
ONE = {"tasks_per_node": 1, "timeout_min": 2}
TWO = {"tasks_per_node": 2, "timeout_min": 2}
LONG = {"tasks_per_node": 2, "timeout_min": 3}
# Two ranks that need every CPU of both nodes: pending while anything else runs.
WHOLE = {"nodes": 2, "tasks_per_node": 1, "cpus_per_task": 4, "timeout_min": 3}


@dataclass
class Case:
    """One job of a scenario and the end it must reach."""

    name: str
    backend: str
    entrypoint: str
    expect: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=lambda: dict(ONE))
    reason_has: str = ""
    id: int = 0

    def body(self) -> dict[str, Any]:
        # No retries: each job goes out once, which the scenarios check (retries: test_retries_slurm).
        return {"name": self.name, "backend": self.backend, "entrypoint": f"worker.tasks.{self.entrypoint}",
                "kwargs": self.kwargs, "resources": self.resources, "retries": {"max": 0}}


def ok(name: str, backend: str, **resources: Any) -> Case:
    if backend == "local":
        return Case(name, backend, "faults:sleep", "succeeded", {"seconds": 0})
    return Case(name, backend, "faults:hostnames", "succeeded", resources=resources or dict(TWO))


def sleeper(name: str, backend: str, seconds: float, **resources: Any) -> Case:
    return Case(name, backend, "faults:sleep", "succeeded", {"seconds": seconds}, resources or dict(LONG))


def raiser(name: str, backend: str) -> Case:
    return Case(name, backend, "faults:raise_on_rank", "failed", {"rank": 1, "message": f"boom {name}"},
                dict(TWO), reason_has=f"boom {name}")


def exiter(name: str, backend: str, code: int) -> Case:
    return Case(name, backend, "faults:exit_on_rank", "failed", {"rank": 0, "code": code})


def check_end(api: Api, case: Case, timeout: float) -> dict[str, Any]:
    done = api.finished(case.id, timeout=timeout)
    assert done["state"] == case.expect, (case.name, done["state"], done["reason"])
    assert case.reason_has in (done["reason"] or ""), (case.name, done["reason"])
    if case.entrypoint == "faults:sleep" and case.expect == "succeeded":
        assert done["result"]["slept_s"] >= case.kwargs["seconds"], case.name
    if case.entrypoint == "faults:hostnames":
        ranks = case.resources.get("nodes", 1) * case.resources["tasks_per_node"]
        assert done["result"]["world_size"] == ranks, case.name
    return done


def check_one_submission_each(jobs: list[dict[str, Any]], data_dir: Path, since: str) -> None:
    """Each job went out once: one submitit submission in its folder, one SLURM job per SLURM job."""
    for one in jobs:
        assert submissions(one["folder"]) == [one["external_id"]], one["name"]
    slurm_ids = sorted(one["external_id"] for one in jobs if one["backend"] == "slurm")

    def accounted() -> list[str]:
        return sorted(row["id"] for row in sacct_jobs(since, data_dir))

    # slurmdbd hears of jobs from slurmctld's agent queue, which lags behind after a controller
    # restart (once, an array element had ended and was not in sacct yet): give it time to catch up.
    deadline = time.monotonic() + 30
    while (listed := accounted()) != slurm_ids and time.monotonic() < deadline:
        time.sleep(1)
    assert listed == slurm_ids  # no second sbatch of anything, no orphan SLURM job
    assert len(set(slurm_ids)) == len(slurm_ids)


def ledger_states(database: Path) -> Counter[str]:
    """The ledger as the killed service left it (read straight from the file: nobody serves it)."""
    with sqlite3.connect(database) as connection:
        rows = connection.execute("SELECT state, claimed_by IS NOT NULL FROM job").fetchall()
    return Counter(f"{state}{'+claimed' if claimed else ''}" for state, claimed in rows)


def test_sigkill_with_twenty_jobs_in_flight_on_both_backends(tmp_path: Path) -> None:
    database = tmp_path / "ledger.db"
    workdir = tmp_path / "cwd"
    env = service_env(tmp_path / "data", f"sqlite:///{database}", default_backend="slurm",
                      reconcile_interval_s="1")
    slow = tmp_path / "slow-sbatch"  # while it exists, a real sbatch waits 5 s before it runs
    env["PATH"] = f"{slow_sbatch(tmp_path / 'bin', tmp_path / 'sbatch-started', 5, slow)}:{env['PATH']}"
    token = ledger_token(f"sqlite:///{database}")
    since = slurm_now()
    # Started first, still running (or pending behind them) when the service dies.
    early = [sleeper("s-sleep-1", "slurm", 15), sleeper("s-sleep-2", "slurm", 15),
             sleeper("l-sleep-1", "local", 12, **ONE), sleeper("l-sleep-2", "local", 12, **ONE),
             ok("s-whole-1", "slurm", **WHOLE), ok("s-whole-2", "slurm", **WHOLE)]
    # Submitted just before the kill: most are submitted or starting; they end while nobody watches.
    late = [ok("s-ok-1", "slurm"), ok("s-ok-2", "slurm"), raiser("s-raise", "slurm"),
            exiter("s-exit", "slurm", 5), ok("l-ok-1", "local"), ok("l-ok-2", "local"),
            ok("l-ok-3", "local"), raiser("l-raise", "local"), exiter("l-exit", "local", 7)]
    # The last burst, the kill follows the last POST at once: some are still queued (or claimed).
    burst = [ok("l-burst-1", "local"), ok("s-burst-1", "slurm"), ok("l-burst-2", "local"),
             ok("s-burst-2", "slurm"), ok("l-burst-3", "local")]
    cases = early + late + burst
    assert Counter(case.backend for case in cases) == {"local": 10, "slurm": 10}

    first = ServiceProcess(env, tmp_path / "first.log", cwd=workdir)
    api = Api(first.url, token)
    try:
        for case in early:
            case.id = api.submit(**case.body())["id"]

        def early_settled() -> bool:
            got = {case.name: api.job(case.id)["state"] for case in early}
            return all(got[c.name] == "running" for c in early[:4]) and all(
                got[c.name] == "pending" for c in early[4:])

        wait_for(early_settled, 90, "4 sleepers running and 2 whole-cluster jobs pending")
        for case in late:
            case.id = api.submit(**case.body())["id"]
        # All at once, and the kill as soon as the last is answered: the dispatcher takes a batch
        # within milliseconds of its commit, so one POST after another would leave nothing queued.
        # Even so it could hand the whole burst over before the last answer reached us (it did once):
        # the burst's SLURM jobs wait in a slow sbatch, so the kill always catches some claimed.
        slow.touch()
        with ThreadPoolExecutor(len(burst)) as pool:
            answers = pool.map(lambda one: api.submit(**one.body()), burst)
            for case, created in zip(burst, answers, strict=True):
                case.id = created["id"]
    finally:
        first.kill()
        slow.unlink(missing_ok=True)  # an sbatch begun before the kill still waits, and then runs
    at_kill = ledger_states(database)
    before = {one["id"]: one["external_id"] for one in _rows(database)}
    time.sleep(3)  # jobs run on, and some end, with nobody watching

    second = ServiceProcess(env, tmp_path / "second.log", cwd=workdir)
    api = Api(second.url, token)
    try:
        for case in cases:
            check_end(api, case, timeout=150)
        jobs = api.all_jobs()
        assert sorted(one["id"] for one in jobs) == sorted(case.id for case in cases)  # 20 rows, no more
        for one in jobs:
            if before[one["id"]] is not None:
                assert one["external_id"] == before[one["id"]], one["name"]  # re-attached, not resubmitted
            check_history(api, one["id"])
        check_one_submission_each(jobs, tmp_path / "data", since)
    finally:
        second.stop()
        scancel(one["external_id"] for one in _rows(database) if one["backend"] == "slurm")
    dispatched = sum(v is not None for v in before.values())
    print(f"\nat the kill: {dict(at_kill)}; {dispatched} of 20 had an external id")
    # Some jobs were handed to a backend only after the restart: the kill really caught jobs in intake.
    assert at_kill.get("queued", 0) + at_kill.get("queued+claimed", 0) >= 1, at_kill
    assert at_kill["running"] >= 4 and at_kill["pending"] >= 2, at_kill


def slow_sbatch(folder: Path, started: Path, seconds: float, only_while: Path | None = None) -> Path:
    """A `sbatch` first on PATH that, for a real submission (while `only_while` exists, when given),
    notes that it began and waits before it runs the real one: a window in which to kill the service
    while its sbatch is in flight."""
    real = shutil.which("sbatch")
    assert real is not None
    folder.mkdir(parents=True)
    wrapper = folder / "sbatch"
    when = f"[ -e {only_while} ] && " if only_while is not None else ""
    wrapper.write_text(
        "#!/bin/bash\n"
        f'if {when}[[ " $* " != *" --test-only "* ]]; then touch {started}; sleep {seconds}; fi\n'
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    return folder


def test_sigkill_while_its_sbatch_runs_adopts_the_job_that_sbatch_queued(tmp_path: Path) -> None:
    """The sbatch a killed service started outlives it and queues the job. The restarted service must
    wait for that sbatch, find the job by its script, and let it run: one SLURM job, not two."""
    database = tmp_path / "ledger.db"
    workdir = tmp_path / "cwd"
    started = tmp_path / "sbatch-started"
    env = service_env(tmp_path / "data", f"sqlite:///{database}", default_backend="slurm",
                      reconcile_interval_s="1")
    env["PATH"] = f"{slow_sbatch(tmp_path / 'bin', started, 4)}:{env['PATH']}"
    token = ledger_token(f"sqlite:///{database}")
    since = slurm_now()
    case = ok("killed-in-sbatch", "slurm")

    first = ServiceProcess(env, tmp_path / "first.log", cwd=workdir)
    try:
        case.id = Api(first.url, token).submit(**case.body())["id"]
        wait_for(started.exists, 30, "the dispatcher's sbatch to start")
    finally:
        first.kill()
    assert ledger_states(database) == {"queued+claimed": 1}  # the kill caught it inside sbatch

    second = ServiceProcess(env, tmp_path / "second.log", cwd=workdir)
    api = Api(second.url, token)
    try:
        done = check_end(api, case, timeout=120)
        jobs = api.all_jobs()
        check_history(api, case.id)
        # Accounting learns of a job that ended a moment ago a little later than squeue does.
        def accounted() -> bool:
            return any(row["id"] == done["external_id"] for row in sacct_jobs(since, tmp_path / "data"))

        wait_for(accounted, 60, "the job in SLURM's accounting")
        check_one_submission_each(jobs, tmp_path / "data", since)
        reasons = [event["reason"] for event in api.get(f"/api/v1/jobs/{case.id}/events").json()]
        assert "adopted after a dispatcher restart" in reasons, reasons
    finally:
        second.stop()
        scancel(one["external_id"] for one in _rows(database))


def _rows(database: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(database) as connection:
        connection.row_factory = sqlite3.Row
        return [dict(row) for row in connection.execute("SELECT id, backend, external_id FROM job")]


# ---------------------------------------------------------------- slurmctld outage


FAILED_POLL = re.compile(r"slurm status query failed .*; next try in (\d+) s")


def controller(action: str) -> None:
    """Stop or start slurmctld alone (deploy/slurm/controller.sh); nodes and running jobs stay.

    A started controller knows its nodes' state only once their slurmd have registered again: until
    then it refuses a 2-node request ("Requested node configuration is not available"), so `start`
    returns once no node is in state unknown, and the next test finds the cluster whole."""
    subprocess.run(["bash", str(CONTROLLER), action], check=True, timeout=90, capture_output=True)
    if action == "start":
        wait_for(lambda: "unk" not in _node_states(), 60, "the nodes to register with the controller")


def _node_states() -> str:
    done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=30)
    return done.stdout if done.returncode == 0 else "unk"


def metric(api: Api, name: str) -> float:
    text = api.get("/metrics").raise_for_status().text
    found = re.search(rf'^{name}\{{backend="slurm"\}} (\S+)$', text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_slurmctld_restart_while_jobs_run(tmp_path: Path) -> None:
    database = tmp_path / "ledger.db"
    workdir = tmp_path / "cwd"
    env = service_env(tmp_path / "data", f"sqlite:///{database}", default_backend="slurm",
                      reconcile_interval_s="1")
    token = ledger_token(f"sqlite:///{database}")
    since = slurm_now()
    service = ServiceProcess(env, tmp_path / "service.log", cwd=workdir)
    api = Api(service.url, token)
    # Ends while the controller is down; still running after it is back; waits for the whole cluster.
    short, long_ = sleeper("short", "slurm", 6), sleeper("long", "slurm", 30)
    whole = ok("whole", "slurm", **WHOLE)
    # Submitted during the outage with the shape of `short` (its sbatch --test-only verdict is cached).
    during_ok, during_fail = ok("during-ok", "slurm", **LONG), exiter("during-exit", "slurm", 4)
    during_fail.resources = dict(LONG)
    cases = [short, long_, whole]
    refused: dict[str, Any] = {}
    slowest_read = 0.0
    try:
        for case in cases:
            case.id = api.submit(**case.body())["id"]
        wait_for(lambda: all(api.job(c.id)["state"] == "running" for c in (short, long_)), 90, "running")
        wait_for(lambda: api.job(whole.id)["state"] == "pending", 30, "whole pending")
        polls = metric(api, "torchyard_reconcile_polls_total")
        calls = metric(api, "torchyard_scheduler_calls_total")
        log_mark = service.log.stat().st_size

        controller("stop")
        stopped = time.monotonic()
        try:
            for case in (during_ok, during_fail):
                case.id = api.submit(**case.body())["id"]
                cases.append(case)

            def post_new_shape() -> None:
                began = time.monotonic()
                answer = api.post("/api/v1/jobs", {**during_ok.body(), "resources": {"tasks_per_node": 3}})
                refused.update(status=answer.status_code, text=answer.text, took=time.monotonic() - began)

            poster = threading.Thread(target=post_new_shape)
            poster.start()
            while time.monotonic() < stopped + OUTAGE_S:  # the API answers all along, from the ledger
                began = time.monotonic()
                listed = api.get("/api/v1/jobs")
                read = api.get(f"/api/v1/jobs/{short.id}")
                slowest_read = max(slowest_read, time.monotonic() - began)
                assert listed.status_code == 200 and read.status_code == 200, (listed.text, read.text)
                assert {j["id"] for j in listed.json()["items"]} == {c.id for c in cases}
                # Its last known state, not lost, not guessed; or, once it has ended, what rank 0's
                # result says: the result is read from the job folder, SLURM or not.
                assert read.json()["state"] in ("running", "succeeded"), read.text
                time.sleep(0.5)
            assert api.job(during_ok.id)["state"] == "queued"  # waits for the controller, not failed
            poster.join(timeout=60)
            calls_down = metric(api, "torchyard_scheduler_calls_total") - calls
        finally:
            controller("start")
        outage_s = time.monotonic() - stopped
        # A shape SLURM never judged cannot be checked while it is down: refused, saying why.
        assert refused["status"] == 502, refused
        assert "cannot reach SLURM" in refused["text"], refused
        wait_for(lambda: metric(api, "torchyard_reconcile_polls_total") > polls, 60, "a good poll")
        recovered_s = time.monotonic() - stopped

        for case in cases:
            check_end(api, case, timeout=150)
        jobs = api.all_jobs()
        assert len(jobs) == len(cases)
        for one in jobs:
            check_history(api, one["id"])
        check_one_submission_each(jobs, tmp_path / "data", since)
        failed_polls = [int(m.group(1)) for m in FAILED_POLL.finditer(service.log.read_text()[log_mark:])]
    finally:
        service.stop()
        controller("start")  # whatever happened, the cluster is left up for the next test
        scancel(one["external_id"] for one in _rows(database))
    print(f"\noutage {outage_s:.1f} s, first good poll {recovered_s:.1f} s after the stop; failed polls "
          f"then waited {failed_polls} s; scheduler commands while it was down: {calls_down:.0f}; "
          f"slowest read during the outage {slowest_read:.2f} s; a new shape refused in "
          f"{refused['took']:.1f} s")
    assert slowest_read < 2.0
    # Each command against a stopped controller hangs about 9 s before it fails; polls back off, and the
    # dispatcher retries its sbatch once a dispatch interval after that: no command storm.
    assert calls_down <= OUTAGE_S / 2, calls_down
    # The reconcile loop backed off: each failed poll waits twice as long as the one before.
    assert 1 <= len(failed_polls) <= 4, failed_polls
    assert all(b == 2 * a for a, b in itertools.pairwise(failed_polls)), failed_polls
