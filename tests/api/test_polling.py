"""Cheap polling: ETag / If-None-Match -> 304, `since` with the ledger clock, and no scheduler calls."""

from __future__ import annotations

import asyncio
from datetime import datetime

import httpx
from fastapi.testclient import TestClient
from sqlmodel import Session

from service.app import create_app
from service.config import Settings
from service.domain.transitions import record_transition
from service.ledger.models.jobs import Job
from service.states import JobState
from tests.fakes import FakeBackend
from tests.serving import serve
from tests.support import login_headers, runtime_of, wait_for

JOBS = "/api/v1/jobs"
BODY = {"name": "poll-me", "entrypoint": "worker.tasks.seed:ddp_step"}


def submit(api: TestClient, name: str = "poll-me") -> int:
    response = api.post(JOBS, json={**BODY, "name": name})
    assert response.status_code == 201, response.text
    job_id: int = response.json()["id"]
    return job_id


def state_of(api: TestClient, job_id: int) -> str:
    state: str = api.get(f"{JOBS}/{job_id}").json()["state"]
    return state


def until_state(api: TestClient, job_id: int, state: JobState) -> None:
    wait_for(lambda: state_of(api, job_id) == state.value, what=f"job {job_id} {state.value}")


def _time(text: str) -> datetime:
    return datetime.fromisoformat(text)


def revalidate(api: TestClient, url: str, tag: str) -> httpx.Response:
    response: httpx.Response = api.get(url, headers={"If-None-Match": tag})
    return response


# ---------------------------------------------------------------- ETag / 304


def test_list_answers_304_until_a_job_changes(api: TestClient, fake: FakeBackend) -> None:
    job_id = submit(api)
    until_state(api, job_id, JobState.running)
    first = api.get(JOBS)
    tag = first.headers["ETag"]
    assert first.status_code == 200 and first.headers["Cache-Control"] == "no-cache"

    again = revalidate(api, JOBS, tag)
    assert again.status_code == 304
    assert again.content == b"" and again.headers["ETag"] == tag
    assert tag.startswith('W/"')  # weak: the page's server_time is not in it (service.api.etag)
    # listed tags match, and weak comparison ignores W/
    assert revalidate(api, JOBS, f'"other", {tag.removeprefix("W/")}').status_code == 304
    assert revalidate(api, JOBS, '"something-else"').status_code == 200

    fake.finish(job_id, {"ok": True})
    until_state(api, job_id, JobState.succeeded)
    changed = revalidate(api, JOBS, tag)
    assert changed.status_code == 200 and changed.headers["ETag"] != tag
    assert changed.json()["items"][0]["state"] == "succeeded"


def test_a_change_invalidates_every_page_and_filter_that_shows_it(api: TestClient, fake: FakeBackend) -> None:
    """...and only those: a page whose jobs did not change stays 304 however busy the ledger is."""
    ids = [submit(api, f"job-{n}") for n in range(5)]
    for job_id in ids:
        until_state(api, job_id, JobState.running)
    second_page_url = f"{JOBS}?limit=2&cursor={api.get(JOBS, params={'limit': 2}).json()['next_cursor']}"
    urls = [JOBS, second_page_url, f"{JOBS}?state=running", f"{JOBS}?name=job-0", f"{JOBS}?state=failed"]
    tags = {url: api.get(url).headers["ETag"] for url in urls}
    assert all(revalidate(api, url, tag).status_code == 304 for url, tag in tags.items())

    fake.set_status(ids[0], JobState.failed, "OOM killed")  # job-0: oldest, on page 3 of 2-per-page
    until_state(api, ids[0], JobState.failed)
    for url, tag in tags.items():  # it changed on the first page, left ?state=running, joined failed
        assert revalidate(api, url, tag).status_code == (304 if url == second_page_url else 200), url
    assert [item["id"] for item in api.get(f"{JOBS}?state=failed").json()["items"]] == [ids[0]]


def test_job_events_and_metrics_answer_304_until_that_job_changes(api: TestClient, fake: FakeBackend) -> None:
    job_id, other = submit(api), submit(api, "other")
    until_state(api, job_id, JobState.running)
    until_state(api, other, JobState.running)
    urls = [f"{JOBS}/{job_id}", f"{JOBS}/{job_id}/events", f"{JOBS}/{job_id}/metrics"]
    tags = {url: api.get(url).headers["ETag"] for url in urls}
    assert all(revalidate(api, url, tag).status_code == 304 for url, tag in tags.items())

    fake.set_status(other, JobState.failed, "another job's change")
    until_state(api, other, JobState.failed)
    assert all(revalidate(api, url, tag).status_code == 304 for url, tag in tags.items())

    spec = fake.specs[job_id]
    spec.files.progress.write_text('{"step": 3, "total": 10, "metrics": {"loss": 0.5}, "time": 1}\n')
    wait_for(lambda: api.get(f"{JOBS}/{job_id}").json()["progress"], what="progress in the ledger")
    for url, tag in tags.items():
        fresh = revalidate(api, url, tag)
        assert fresh.status_code == 200 and fresh.headers["ETag"] != tag, url
    assert api.get(f"{JOBS}/{job_id}/metrics").json()[0]["value"] == 0.5
    assert revalidate(api, f"{JOBS}/999", '"x"').status_code == 404


# ---------------------------------------------------------------- since


def test_since_returns_only_what_changed_after_the_last_page(api: TestClient, fake: FakeBackend) -> None:
    ids = [submit(api, f"job-{n}") for n in range(3)]
    for job_id in ids:
        until_state(api, job_id, JobState.running)
    fake.set_status(ids[0], JobState.failed, "bad node")  # the last commit before the page is read
    until_state(api, ids[0], JobState.failed)
    page = api.get(JOBS)
    server_time = page.json()["server_time"]
    assert page.headers["X-Server-Time"] == _time(server_time).isoformat()
    # The jobs of the commit that set the clock come again (a tie is resent, never missed); no others.
    assert ids_of(api.get(JOBS, params={"since": server_time})) == [ids[0]]

    fake.set_status(ids[1], JobState.failed, "bad node")
    until_state(api, ids[1], JobState.failed)
    changed = api.get(JOBS, params={"since": server_time})
    assert ids_of(changed) == [ids[1], ids[0]]
    assert _time(changed.json()["server_time"]) > _time(server_time)


def ids_of(response: httpx.Response) -> list[int]:
    return [item["id"] for item in response.json()["items"]]


def test_since_never_misses_a_transaction_that_commits_late(api: TestClient) -> None:
    """A change made early and committed late must still come after the server_time a reader saw.

    With `updated_at` taken when the row is modified, job A (modified first, committed last) would
    be stamped before the page's server_time and a `since` poller would never see it.
    """
    slow_id, fast_id = submit(api, "slow"), submit(api, "fast")
    until_state(api, slow_id, JobState.running)
    until_state(api, fast_id, JobState.running)
    engine = runtime_of(api).engine
    with Session(engine) as slow, Session(engine) as fast:
        slow_job, fast_job = slow.get(Job, slow_id), fast.get(Job, fast_id)
        assert slow_job is not None and fast_job is not None
        record_transition(slow, slow_job, JobState.cancelled, "modified first")  # stamps updated_at now
        record_transition(fast, fast_job, JobState.cancelled, "committed first")
        fast.commit()
        page = api.get(JOBS).json()  # the reader's page, between the two commits
        slow.commit()
    server_time = page["server_time"]
    seen = {item["id"]: item for item in page["items"]}
    assert seen[fast_id]["state"] == "cancelled" and seen[slow_id]["state"] == "running"
    assert _time(server_time) >= _time(seen[fast_id]["updated_at"])  # the page covers what it shows
    later = api.get(JOBS, params={"since": server_time}).json()["items"]
    assert slow_id in [item["id"] for item in later]


# ---------------------------------------------------------------- readers never reach the scheduler


async def _poll(base: str, paths: list[str], rounds: int, auth: dict[str, str]) -> int:
    """One polling client, like the dashboard: revalidates every path with the tag it last got."""
    tags: dict[str, str] = {}
    answered = 0
    async with httpx.AsyncClient(base_url=base, timeout=30, headers=auth) as client:
        for _ in range(rounds):
            for path in paths:
                headers = {"If-None-Match": tags[path]} if path in tags else {}
                response = await client.get(path, headers=headers)
                assert response.status_code in (200, 304), response.text
                if "ETag" in response.headers:
                    tags[path] = response.headers["ETag"]
                answered += 1
    return answered


def test_fifty_polling_clients_add_zero_scheduler_calls(settings: Settings) -> None:
    # Reconcile only when woken (the backend's wakeup): the interval cannot explain a single call.
    fake = FakeBackend("local", default=JobState.submitted, poll_interval_s=3600.0)
    app = create_app(settings, backends={"local": fake})
    with serve(app) as server:
        auth = login_headers(app)
        created = httpx.post(f"{server.url}{JOBS}", json=BODY, headers=auth).json()
        job_id = created["id"]

        def state() -> str:
            value: str = httpx.get(f"{server.url}{JOBS}/{job_id}", headers=auth).json()["state"]
            return value

        wait_for(lambda: state() == "submitted", what="dispatch recorded in the ledger")
        fake.set_status(job_id, JobState.running)  # wakes the reconciler: one batched poll
        wait_for(lambda: state() == "running", what="running")
        polls_before, ticks_before = len(fake.poll_calls), dict(server.runtime.reconciler.ticks)
        paths = [JOBS, f"{JOBS}/{job_id}", f"{JOBS}/{job_id}/events", f"{JOBS}/{job_id}/metrics"]
        paths += [f"{JOBS}?state=running", f"{JOBS}/{job_id}/logs?rank=0&tail=10", "/metrics"]

        async def everyone() -> list[int]:
            return await asyncio.gather(*(_poll(server.url, paths, rounds=3, auth=auth) for _ in range(50)))

        answered = asyncio.run(everyone())
        assert sum(answered) == 50 * 3 * len(paths)
        assert len(fake.poll_calls) == polls_before
        assert server.runtime.reconciler.ticks == ticks_before
        scraped = httpx.get(f"{server.url}/metrics", headers=auth).text
        assert f'torchyard_reconcile_polls_total{{backend="local"}} {float(polls_before)}' in scraped
