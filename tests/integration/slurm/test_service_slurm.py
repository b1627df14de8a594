"""The whole service on the real two-node SLURM cluster: REST -> ledger -> dispatch -> sbatch (submitit)
-> ranks on n1/n2 -> squeue/sacct -> reconcile -> ledger. No fakes: every request carries a real token
of the ordinary user alice.

Every job costs a few seconds of torch imports, and the cluster has 8 CPUs, so related checks share
jobs and run side by side where they can.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlmodel import Session, col, select

from service.app import create_app
from service.backends.slurm import SlurmBackend
from service.cli.render import parse_time, start_estimate
from service.config import Settings
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.integration.slurm.conftest import Api, ServiceProcess, ledger_token, scancel, service_env
from tests.serving import LiveServer, serve
from tests.support import issue_token, wait_for

pytestmark = pytest.mark.slurm

WHOLE_CLUSTER = {"nodes": 2, "tasks_per_node": 4}  # all 8 CPUs: anything else running makes it wait


def settings_for(tmp_path: Path) -> Settings:
    return Settings(
        job_accounts="service",
        default_backend="slurm",
        data_dir=tmp_path / "data",
        database_url=f"sqlite:///{tmp_path}/ledger.db",
        reconcile_interval_s=1,
        rendezvous_timeout_s=60,
    )


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveServer]:
    with serve(create_app(settings_for(tmp_path))) as server:
        yield server
        scancel_ours(server)


@pytest.fixture
def api(live: LiveServer) -> Api:
    """The live service as the ordinary user alice sees it (a real token, checked on every call)."""
    return Api(live.url, issue_token(live.runtime.engine, "alice"))


def scancel_ours(server: LiveServer) -> None:
    """A failed assertion must not leave the cluster busy for the next test."""
    with Session(server.runtime.engine) as session:
        query = select(Job.external_id).where(col(Job.external_id).is_not(None))
        scancel([str(one) for one in session.exec(query)])


def slurm_of(server: LiveServer) -> SlurmBackend:
    backend = server.runtime.backends["slurm"]
    assert isinstance(backend, SlurmBackend)
    return backend


def test_seed_demonstrations_and_two_hosts(api: Api) -> None:
    ddp = api.submit(name="ddp", entrypoint="worker.tasks.seed:ddp_parameters",
                 resources={"tasks_per_node": 3, "timeout_min": 5})
    shards = api.submit(name="shards", entrypoint="worker.tasks.seed:sampler_shards",
                    resources={"nodes": 2, "tasks_per_node": 2, "timeout_min": 5})
    hosts = api.submit(name="hosts", entrypoint="worker.tasks.faults:hostnames",
                   resources={"nodes": 2, "tasks_per_node": 2, "timeout_min": 5})
    assert ddp["backend"] == "slurm"

    ddp_done = api.finished(ddp["id"], timeout=180)
    assert ddp_done["state"] == "succeeded", ddp_done["reason"]
    result = ddp_done["result"]
    assert result["ok"] is True and result["world_size"] == 3
    assert result["initial_params_match_rank0"] is True
    assert result["params_identical_after_step"] is True
    assert result["matches_averaged_gradient_step"] is True
    assert api.states(ddp["id"])[:2] == ["queued", "submitted"]
    assert api.states(ddp["id"])[-2:] == ["running", "succeeded"]

    shards_done = api.finished(shards["id"], timeout=180)
    assert shards_done["state"] == "succeeded", shards_done["reason"]
    assert shards_done["result"]["ok"] is True
    assert shards_done["result"]["shards"] == {str(r): [r, r + 4] for r in range(4)}
    assert shards_done["result"]["dataset_identical_on_all_ranks"] is True

    hosts_done = api.finished(hosts["id"], timeout=180)
    assert hosts_done["state"] == "succeeded", hosts_done["reason"]
    assert hosts_done["result"]["hostnames"] == ["n1", "n1", "n2", "n2"]
    assert hosts_done["result"]["distinct_hosts"] == 2


def test_more_nodes_than_exist_is_refused_at_post(api: Api) -> None:
    response = api.post("/api/v1/jobs", {
        "name": "huge", "entrypoint": "worker.tasks.faults:hostnames", "resources": {"nodes": 3}})
    assert response.status_code == 422, response.text
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "resources", "nodes"]
    assert "Node count specification invalid" in detail["msg"]
    assert api.all_jobs() == []  # nothing was queued


def test_timeout_failing_rank_and_cancel_pending_and_running(api: Api) -> None:
    # Side by side: the timeout takes a minute of wall time, the rest happens meanwhile.
    slow = api.submit(name="too-slow", entrypoint="worker.tasks.faults:sleep",
                  kwargs={"seconds": 200}, resources={"timeout_min": 1})
    crash = api.submit(name="crash", entrypoint="worker.tasks.faults:exit_on_rank", retries={"max": 0},
                   kwargs={"rank": 1, "code": 3}, resources={"tasks_per_node": 2, "timeout_min": 3})
    runner = api.submit(name="runner", entrypoint="worker.tasks.faults:sleep",
                    kwargs={"seconds": 120}, resources={"timeout_min": 3})
    waiter = api.submit(name="waiter", entrypoint="worker.tasks.faults:sleep",
                    kwargs={"seconds": 1}, resources={**WHOLE_CLUSTER, "timeout_min": 3})

    def running_and_pending() -> dict[str, Any] | None:
        r, w = api.job(runner["id"]), api.job(waiter["id"])
        reason = w["reason"] or ""
        waits = w["state"] == "pending" and ("Resources" in reason or "Priority" in reason)
        return w if r["state"] == "running" and waits else None

    pending = wait_for(running_and_pending, 90, "one job running, the whole-cluster one pending")
    assert pending["external_id"]
    for one in (runner, waiter):
        api.post(f"/api/v1/jobs/{one['id']}/cancel").raise_for_status()
    for one in (runner, waiter):
        done = api.finished(one["id"], timeout=60)
        assert done["state"] == "cancelled", done["reason"]
    gone = subprocess.run(["squeue", "-h", "-j", f"{api.job(runner['id'])['external_id']},"
                           f"{pending['external_id']}", "-t", "PD,R"], capture_output=True, text=True)
    assert gone.stdout.strip() == ""  # SLURM let them go too

    crashed = api.finished(crash["id"], timeout=120)
    assert crashed["state"] == "failed", crashed["reason"]

    # With a limit under submitit's --signal=USR2@90 the warning comes at once: submitit takes it for a
    # time-out of a Checkpointable job and requeues it (up to 3 times) before giving up; the ledger
    # still ends `timeout` once the job has had its minute.
    timed_out = api.finished(slow["id"], timeout=200)
    assert timed_out["state"] == "timeout", timed_out["reason"]


def test_one_status_query_per_interval_whatever_the_readers(
    live: LiveServer, api: Api, tmp_path: Path
) -> None:
    # 200 real SLURM jobs held in the queue (one sbatch of an array), entered in the ledger as another
    # user's (as alice's they would fill her quota of unfinished jobs); an admin reads them all.
    held = subprocess.run(["sbatch", "--parsable", "--hold", "--array=0-199", "-o", "/dev/null",
                           "--wrap", "true"], capture_output=True, text=True, timeout=30, check=True)
    array = held.stdout.strip().split(";")[0]
    try:
        with Session(live.runtime.engine) as session:
            for index in range(200):
                session.add(Job(name=f"held-{index}", owner="carol", backend="slurm",
                                state=JobState.submitted, external_id=f"{array}_{index}",
                                folder=str(tmp_path / "held" / str(index)),
                                spec={"entrypoint": "worker.tasks.faults:sleep", "resources": {}}))
            session.commit()
        real = [api.submit(name=f"real-{n}", entrypoint="worker.tasks.faults:sleep",
                       kwargs={"seconds": 30}, resources={"timeout_min": 2}) for n in range(2)]
        wait_for(lambda: all(api.job(r["id"])["state"] == "running" for r in real), 60, "running")
        admin = Api(live.url, issue_token(live.runtime.engine, "root", admin=True))
        held_job = admin.job(1)
        wait_for(lambda: admin.job(1)["state"] == "pending", 10, "held job pending")
        assert "JobHeldUser" in (admin.job(1)["reason"] or ""), held_job

        backend, reconciler = slurm_of(live), live.runtime.reconciler
        stop = threading.Event()
        reads = [0] * 20

        def reader(n: int) -> None:
            with httpx.Client(base_url=live.url, headers=admin.headers, timeout=30) as client:
                while not stop.is_set():
                    client.get(f"/api/v1/jobs/{1 + (n * 10 + reads[n]) % 202}").raise_for_status()
                    client.get("/api/v1/jobs", params={"limit": 50}).raise_for_status()
                    reads[n] += 1

        calls, ticks = backend.scheduler_calls, reconciler.ticks["slurm"]
        started = time.monotonic()
        threads = [threading.Thread(target=reader, args=(n,)) for n in range(20)]
        for thread in threads:
            thread.start()
        time.sleep(6)
        stop.set()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - started
        calls, ticks = backend.scheduler_calls - calls, reconciler.ticks["slurm"] - ticks
        assert sum(reads) > 100  # the readers really read
        assert ticks <= elapsed / 1 + 2  # one tick per interval of 1 s
        assert ticks >= 3
        assert calls <= ticks + 1, (calls, ticks)  # one squeue per tick for 202 jobs; readers add none
    finally:
        subprocess.run(["scancel", array], capture_output=True, timeout=30, check=False)


def test_service_killed_with_jobs_pending_and_running_settles_them_after_restart(tmp_path: Path) -> None:
    database_url = f"sqlite:///{tmp_path}/ledger.db"
    env = service_env(tmp_path / "data", database_url, default_backend="slurm", reconcile_interval_s="1")
    token = ledger_token(database_url)
    first = ServiceProcess(env, tmp_path / "first.log")
    api = Api(first.url, token)
    before: dict[int, str] = {}
    try:
        slow = api.submit(name="slow", entrypoint="worker.tasks.faults:sleep", kwargs={"seconds": 15},
                          resources={"timeout_min": 3})
        crash = api.submit(name="crash", entrypoint="worker.tasks.faults:exit_on_rank", retries={"max": 0},
                           kwargs={"rank": 0, "code": 5}, resources={"timeout_min": 3})
        wait_for(lambda: api.job(slow["id"])["state"] == "running", 90, "slow running")
        later = api.submit(name="later", entrypoint="worker.tasks.faults:hostnames",
                           resources={**WHOLE_CLUSTER, "timeout_min": 3})
        wait_for(lambda: api.job(later["id"])["state"] == "pending", 30, "later pending")
        before = {j["id"]: j["external_id"] for j in api.all_jobs()}
    finally:
        first.kill()
    time.sleep(3)  # SLURM goes on without us
    second = ServiceProcess(env, tmp_path / "second.log")
    api = Api(second.url, token)
    try:
        slow_done = api.finished(slow["id"], timeout=120)
        later_done = api.finished(later["id"], timeout=120)
        crash_done = api.finished(crash["id"], timeout=60)
        assert slow_done["state"] == "succeeded", slow_done["reason"]
        assert slow_done["result"]["slept_s"] >= 15
        assert later_done["state"] == "succeeded", later_done["reason"]
        assert later_done["result"]["distinct_hosts"] == 2
        assert crash_done["state"] == "failed", crash_done["reason"]
        listed = api.all_jobs()
        assert {j["id"]: j["external_id"] for j in listed} == before  # re-attached, nothing resubmitted
        for one in (slow, later, crash):
            assert api.states(one["id"]).count("submitted") == 1
        names = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID", "-j", ",".join(before.values())],
                               capture_output=True, text=True, timeout=30).stdout.split()
        assert sorted(names) == sorted(before.values())
    finally:
        second.stop()
        scancel(before.values())


def test_preempted_and_requeued_training_resumes_from_its_checkpoint_bit_for_bit(api: Api) -> None:
    # Long enough after the first checkpoint to outlive KillWait (5 s): a requeue's SIGTERM is ignored
    # by submitit, so the ranks only stop at the SIGKILL that follows.
    kwargs = {"epochs": 6, "samples": 256, "seed": 7, "report_every": 2, "sleep_per_step": 0.6}
    resources = {"tasks_per_node": 2, "timeout_min": 5}
    kept = {"keep_last": 2}  # the requeued runs prune as they go, and still resume from the newest
    plain, signalled, requeued = (
        api.submit(name=name, entrypoint="worker.tasks.train:train", kwargs=kwargs, resources=resources,
                   **({} if name == "plain" else {"checkpoints": kept}))
        for name in ("plain", "signalled", "requeued")
    )  # fmt: skip

    def checkpointed(one: dict[str, Any]) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            j = api.job(one["id"])
            return j if j["latest_checkpoint"] and j["state"] == "running" else None

        return wait_for(probe, 120, f"a first checkpoint of {one['name']}")

    # What SLURM sends before a time limit (`--signal=B:USR2@N`): USR2 to the batch step, the job's
    # supervisor. submitit's handler there asks Supervisor.checkpoint() for the resubmission and runs
    # `scontrol requeue` itself; the supervisor's ranks go with its step.
    mid = checkpointed(signalled)
    subprocess.run(["scancel", "--batch", "--signal=USR2", str(mid["external_id"])], check=True, timeout=30)
    # An operator's (or a node failure's) requeue: no signal, submitit reruns its pickle.
    mid_requeued = checkpointed(requeued)
    subprocess.run(["scontrol", "requeue", str(mid_requeued["external_id"])], check=True, timeout=30)
    for one, before in ((signalled, mid), (requeued, mid_requeued)):

        def second_attempt(job_id: int = one["id"]) -> dict[str, Any] | None:
            j = api.job(job_id)
            return j if j["attempt"] == 2 else None

        again = wait_for(second_attempt, 60, f"attempt 2 of {one['name']}")
        assert again["external_id"] == before["external_id"]  # the same SLURM job, requeued

    plain_done = api.finished(plain["id"], timeout=180)
    assert plain_done["state"] == "succeeded", plain_done["reason"]
    assert plain_done["result"]["resumed_from_epoch"] is None
    for one in (signalled, requeued):
        done = api.finished(one["id"], timeout=180)
        assert done["state"] == "succeeded", (one["name"], done["reason"])
        assert done["result"]["resumed_from_epoch"] is not None, one["name"]
        assert done["result"]["param_checksum"] == plain_done["result"]["param_checksum"], one["name"]
        assert done["attempt"] == 2
        history = api.states(one["id"])
        at = history.index("requeued")
        assert "running" in history[at:], history
        assert history[-1] == "succeeded"
        listed = api.get(f"/api/v1/jobs/{one['id']}/checkpoints").raise_for_status().json()
        last_two = ["ckpt-00000020.pt", "ckpt-00000024.pt"]  # epochs 5 and 6, 4 steps each
        assert [c["name"] for c in listed] == last_two, one["name"]


def test_a_job_behind_a_blocker_shows_the_schedulers_start_estimate(api: Api) -> None:
    # Two ranks holding all 8 CPUs each time (cheaper than eight ranks): the waiter can start only
    # when the blocker ends, at the latest at the end of its two-minute limit, as SLURM estimates.
    cluster = {"nodes": 2, "tasks_per_node": 1, "cpus_per_task": 4, "timeout_min": 2}
    blocker = api.submit(name="blocker", entrypoint="worker.tasks.faults:sleep",
                         kwargs={"seconds": 110}, resources=cluster)
    try:
        wait_for(lambda: api.job(blocker["id"])["state"] == "running", 90, "the blocker running")
        waiter = api.submit(name="waiter", entrypoint="worker.tasks.faults:sleep",
                            kwargs={"seconds": 1}, resources=cluster)

        def estimated() -> dict[str, Any] | None:
            # Both: squeue can give a start time before the scheduler has looked at the job, while
            # its reason is still "None" (no reason, in the ledger), as it was in one CI run.
            job = api.job(waiter["id"])
            return job if job["state"] == "pending" and job["expected_start_at"] and job["reason"] else None

        waiting = wait_for(estimated, 60, "a start estimate for the waiting job")
        expected = parse_time(waiting["expected_start_at"])
        started = parse_time(api.job(blocker["id"])["started_at"])
        assert expected is not None and started is not None
        assert datetime.now(timezone.utc) < expected <= started + timedelta(minutes=2, seconds=30), waiting
        assert "Resources" in (waiting["reason"] or "") or "Priority" in (waiting["reason"] or ""), waiting
        shown = start_estimate(waiting)
        assert shown.startswith("starts in about ") and "reason: " in shown, shown
    finally:
        for one in api.all_jobs():
            api.post(f"/api/v1/jobs/{one['id']}/cancel")
