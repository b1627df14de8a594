"""Two service replicas on ONE PostgreSQL ledger and one data folder, both serving the API and both
running their dispatch and reconcile loops: each queued job goes out exactly once.

The end-to-end test runs two real processes against the real SLURM cluster, so SLURM's own queue and
accounting are the ground truth: each replica runs in a working directory of its own, and the SLURM
job's WorkDir says which replica's sbatch made it. (The ledger's claimed_by cannot say: a claim is
cleared once the backend has answered.) The in-process test looks at the claim query itself.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlmodel import Session, select

from service.config import Settings
from service.ledger.db import make_engine, migrate
from service.ledger.models.jobs import Job
from service.ledger.models.sweeps import Sweep
from service.loops import sweep_claims
from service.loops.dispatch import Dispatcher
from service.states import JobState
from tests.fakes import FakeBackend
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
from tests.support import PostgresServer, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.postgres]

JOBS = 60


@pytest.mark.slurm
def test_two_replica_processes_dispatch_every_job_exactly_once(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    url = postgres_server.reset_ledger()
    since = slurm_now()
    # A short dispatch interval: besides the wake-up on their own POSTs, both replicas sweep the queue
    # five times a second, so each meets the other's jobs too and the claims really race.
    data = tmp_path / "data"
    env = service_env(data, url, default_backend="slurm", reconcile_interval_s="1", dispatch_interval_s="0.2")
    token = ledger_token(url)
    logs = {name: tmp_path / f"{name}-sbatch.log" for name in ("a", "b")}  # what each replica queued
    # The cluster held by a job of our own: the 60 stay pending, so checking them costs no torch imports.
    blocker = subprocess.run(["sbatch", "--parsable", "-N", "2", "--exclusive", "-t", "5", "-J", "ty-blocker",
                              "-o", "/dev/null", "--wrap", "sleep 300"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    replicas: list[ServiceProcess] = []
    created: list[dict[str, Any]] = []
    try:
        wait_for(lambda: _squeue_state(blocker) == "RUNNING", 30, "the blocker to run")
        replicas = [
            ServiceProcess({**env, "PATH": f"{logging_sbatch(tmp_path / name, log)}:{env['PATH']}"},
                           tmp_path / f"{name}.log", cwd=tmp_path / name)
            for name, log in logs.items()
        ]
        apis = [Api(replica.url, token) for replica in replicas]

        def post(n: int) -> dict[str, Any]:
            return apis[n % 2].submit(name=f"r-{n}", entrypoint="worker.tasks.faults:sleep",
                                      kwargs={"seconds": 0}, resources={"timeout_min": 2})

        with ThreadPoolExecutor(6) as pool:  # job n to replica n % 2, six POSTs in flight at a time
            created = list(pool.map(post, range(JOBS)))
        ids = {one["id"] for one in created}
        assert len(ids) == JOBS
        for n, one in enumerate(created):  # each replica answers for the jobs the other one took in
            assert apis[(n + 1) % 2].job(one["id"])["name"] == one["name"]
        for api in apis:
            assert {one["id"] for one in api.all_jobs()} == ids

        def all_pending() -> list[dict[str, Any]] | None:
            rows = apis[0].all_jobs()
            return rows if all(row["state"] == "pending" for row in rows) else None

        rows = wait_for(all_pending, 60, "all 60 dispatched and pending behind the blocker")
        external = {row["id"]: row["external_id"] for row in rows}
        assert len(set(external.values())) == JOBS  # one SLURM job id each, none shared
        for row in rows:
            assert submissions(row["folder"]) == [row["external_id"]], row["name"]  # one submission each
        queued = {name: _queued_by(log) for name, log in logs.items()}  # SLURM's word, by submitter
        print(f"\nSLURM jobs by replica: { {name: len(got) for name, got in queued.items()} }")
        assert not queued["a"] & queued["b"]
        assert queued["a"] | queued["b"] == set(external.values())  # no orphan: each sbatch is in the ledger
        assert _squeue_ids(data) == set(external.values())
        assert queued["a"] and queued["b"], queued  # both replicas dispatched

        # Cancel all but 6 through the replica that did NOT take the job in; the 6 then run.
        runners = created[:6]
        for n, one in enumerate(created[6:], start=6):
            cancelled = apis[(n + 1) % 2].post(f"/api/v1/jobs/{one['id']}/cancel").raise_for_status().json()
            assert cancelled["state"] == "cancelled"
        scancel([blocker])
        for n, one in enumerate(runners):
            done = apis[(n + 1) % 2].finished(one["id"], timeout=120)
            assert done["state"] == "succeeded", (one["name"], done["reason"])
        for one in created:
            check_history(apis[1], one["id"])  # both reconcilers wrote; no state entered twice
        final = apis[1].all_jobs()
        assert Counter(row["state"] for row in final) == {"cancelled": JOBS - 6, "succeeded": 6}
        assert {row["id"]: row["external_id"] for row in final} == external  # nothing went out again
        for row in final:
            assert submissions(row["folder"]) == [row["external_id"]], row["name"]  # still one each
        assert not _squeue_ids(data)  # nothing of ours left in SLURM
        # Accounting has no orphan and no repeat either. (Not equality: an array element cancelled while
        # its array waits may never reach sacct, a SLURM 22.05 quirk; the queue above saw every one.)
        # A one-element array cancelled before it ran is accounted under its bare id ("1774" for the
        # ledger's "1774_0"), as sacct on this cluster shows it.
        ours = set(external.values())
        accounted = Counter(
            job["id"] if job["id"] in ours or f"{job['id']}_0" not in ours else f"{job['id']}_0"
            for job in sacct_jobs(since, data)
        )
        assert set(accounted) <= ours and set(accounted.values()) == {1}, accounted
    finally:
        for replica in replicas:
            replica.stop()
        scancel([blocker, *(one.get("external_id") for one in created)])


def test_two_replica_processes_admit_exactly_a_users_limit_of_unfinished_jobs(
    postgres_server: PostgresServer, tmp_path: Path
) -> None:
    """15 POSTs at once, alternating between two replicas, for a user with room for 5: the replicas'
    own counts are fresh (each has just counted alice's none), so only the count in the intake's
    transaction stands between them and 10 jobs. Exactly 5 are taken in, 10 get 429."""
    url = postgres_server.reset_ledger()
    env = service_env(tmp_path / "data", url, max_active_jobs_per_user="5")
    token = ledger_token(url)
    replicas: list[ServiceProcess] = []
    accepted: list[dict[str, Any]] = []
    try:
        replicas = [ServiceProcess(env, tmp_path / f"{name}.log", cwd=tmp_path / name) for name in "ab"]
        apis = [Api(replica.url, token) for replica in replicas]
        for api in apis:  # each replica counts alice's unfinished jobs now: none
            assert api.get("/api/v1/jobs").raise_for_status().json()["items"] == []
        barrier = threading.Barrier(15)

        def post(n: int) -> httpx.Response:
            barrier.wait()
            return apis[n % 2].post(
                "/api/v1/jobs",
                json={
                    "name": f"q-{n}",
                    "entrypoint": "worker.tasks.faults:sleep",
                    "kwargs": {"seconds": 120},
                },
            )

        with ThreadPoolExecutor(15) as pool:
            answers = list(pool.map(post, range(15)))
        accepted = [answer.json() for answer in answers if answer.status_code == 201]
        refused = [answer for answer in answers if answer.status_code == 429]
        print(f"\nby replica: { {n: Counter(a.status_code for a in answers[n::2]) for n in (0, 1)} }")

        assert (len(accepted), len(refused)) == (5, 10), [answer.status_code for answer in answers]
        assert all("your limit is 5" in answer.text for answer in refused)
        assert all(int(answer.headers["Retry-After"]) >= 1 for answer in refused)
        assert len(apis[1].all_jobs()) == 5
    finally:
        for one in accepted:
            Api(replicas[0].url, token).post(f"/api/v1/jobs/{one['id']}/cancel")
        for one in accepted:
            Api(replicas[0].url, token).finished(one["id"], timeout=60)
        for replica in replicas:
            replica.stop()


def _squeue_state(job_id: str) -> str:
    done = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                          timeout=30)
    return done.stdout.strip()


def _squeue_ids(data_dir: Path) -> set[str]:
    """Every job SLURM holds of the service with this data directory (array elements one by one): a
    job's working directory is its folder, or its array's, both in there."""
    done = subprocess.run(["squeue", "-h", "-r", "-a", "-o", "%i|%Z"], capture_output=True, text=True,
                          timeout=30, check=True)
    rows = (line.split("|", 1) for line in done.stdout.splitlines() if "|" in line)
    return {job_id for job_id, where in rows if Path(where).is_relative_to(data_dir)}


def logging_sbatch(folder: Path, log: Path) -> Path:
    """A folder whose `sbatch`, first on one replica's PATH, notes each job id the real one printed."""
    real = shutil.which("sbatch")
    assert real is not None
    folder.mkdir(parents=True, exist_ok=True)
    wrapper = folder / "sbatch"
    wrapper.write_text(
        "#!/bin/bash\n"
        f'out=$({real} "$@"); status=$?\n'
        f'[[ " $* " == *" --test-only "* ]] || echo "$out" >> {log}\n'
        'echo "$out"; exit $status\n'
    )
    wrapper.chmod(0o755)
    return folder


def _queued_by(log: Path) -> set[str]:
    """The SLURM ids (array elements one by one) of the sbatch calls in `log`."""
    ids: set[str] = set()
    for line in log.read_text().splitlines() if log.exists() else []:
        job_id = line.split(";")[0].strip()
        if job_id:
            ids.update(_squeue_elements(job_id))
    return ids


def _squeue_elements(job_id: str) -> set[str]:
    """A single job's id, or every element id of an array job as squeue lists them."""
    done = subprocess.run(["squeue", "-h", "-r", "-j", job_id, "-o", "%i"], capture_output=True, text=True,
                          timeout=30, check=True)
    return set(done.stdout.split())


# ---------------------------------------------------------------- the claim query itself


@pytest.fixture
def ledger(postgres_server: PostgresServer) -> Iterator[sa.Engine]:
    engine = make_engine(postgres_server.reset_ledger())
    migrate(engine)
    yield engine
    engine.dispose()


def test_two_dispatchers_racing_on_postgres_claim_with_skip_locked(ledger: sa.Engine, tmp_path: Path) -> None:
    with Session(ledger) as session:
        for n in range(300):
            session.add(Job(name=f"q-{n}", backend="slurm", folder=str(tmp_path / "jobs" / str(n)),
                            spec={"entrypoint": "worker.tasks.faults:sleep", "resources": {}}))
        session.commit()
    settings = Settings(
        data_dir=tmp_path,
        database_url=str(ledger.url),
        dispatch_batch_size=20,
        job_accounts="service",
    )
    fakes = [FakeBackend("slurm"), FakeBackend("slurm")]
    # Two dispatchers with engines (connection pools) of their own, as two replicas have.
    engines = [make_engine(ledger.url.render_as_string(hide_password=False)) for _ in fakes]
    claims: list[str] = []
    for engine in engines:

        @sa.event.listens_for(engine, "before_cursor_execute")
        def note(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "FOR UPDATE" in statement and "claimed_by IS NULL" in statement:
                claims.append(statement)

    pairs = zip(engines, fakes, strict=True)
    dispatchers = [Dispatcher(engine, {"slurm": fake}, settings) for engine, fake in pairs]
    start = threading.Barrier(2)

    def drain(dispatcher: Dispatcher) -> None:
        start.wait()
        while dispatcher.dispatch_once():
            pass

    run_together([functools.partial(drain, one) for one in dispatchers], engines)

    # FOR UPDATE OF job: the claim's order (service.loops.fair_claims) is a window function's.
    skipping = [claim for claim in claims if claim.rstrip().endswith("FOR UPDATE OF job SKIP LOCKED")]
    assert claims and skipping == claims, claims[:1]
    submitted = Counter(job_id for fake in fakes for call in fake.submit_calls for job_id in call)
    assert len(submitted) == 300 and set(submitted.values()) == {1}  # every job exactly once
    assert all(fake.submit_calls for fake in fakes), [len(f.submit_calls) for f in fakes]  # both took some
    with Session(ledger) as session:
        states = Counter(JobState(job.state) for job in session.exec(select(Job)))
    assert states == {JobState.submitted: 300}


def test_two_dispatchers_hold_a_sweep_to_its_max_parallel_together(
    ledger: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each claim counts a sweep's trials under way after locking the sweep's row: a second replica's
    claim, made while the first one's is still open, waits for it and counts its trials."""
    with Session(ledger) as session:
        sweep = Sweep(name="s", owner="alice", backend="local", request={}, size=10, max_parallel=2,
                      metric="loss", goal="min")  # fmt: skip
        session.add(sweep)
        session.flush()
        for n in range(10):
            session.add(Job(name=f"t-{n}", backend="local", sweep_id=sweep.id,
                            folder=str(tmp_path / "jobs" / str(n)),
                            spec={"entrypoint": "worker.tasks.faults:sleep", "resources": {}}))  # fmt: skip
        session.commit()
    # A batch of 4: the first claim locks 4 trials (and starts 2), the second finds 4 others.
    settings = Settings(data_dir=tmp_path, database_url=str(ledger.url), dispatch_batch_size=4,
                        job_accounts="service")  # fmt: skip
    fakes = [FakeBackend("local"), FakeBackend("local")]
    engines = [make_engine(ledger.url.render_as_string(hide_password=False)) for _ in fakes]
    first, second = (
        Dispatcher(engine, {"local": fake}, settings) for engine, fake in zip(engines, fakes, strict=True)
    )
    counted = sweep_claims.room_now
    first_counted = threading.Event()

    def first_claim_stays_open(*args: Any) -> dict[int, int]:
        room = counted(*args)
        if not first_counted.is_set():
            first_counted.set()
            time.sleep(1.0)  # the second claim runs meanwhile
        return room

    monkeypatch.setattr(sweep_claims, "room_now", first_claim_stays_open)

    def second_claim() -> None:
        first_counted.wait(timeout=30)
        second.dispatch_once()

    run_together([first.dispatch_once, second_claim], engines)

    submitted = [job_id for fake in fakes for call in fake.submit_calls for job_id in call]
    assert len(submitted) == 2, [fake.submit_calls for fake in fakes]


def run_together(work: list[Callable[[], object]], engines: list[sa.Engine]) -> None:
    """Each of `work` in a thread of its own, until all are done; then the replicas' engines closed."""
    threads = [threading.Thread(target=one) for one in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    for engine in engines:
        engine.dispose()
