"""What makes the one read path (service.api.fragments) correct: a job changed by a commit is never
served as it was before that commit, a rendering kept for one user's job never reaches another user,
and what is kept stays bounded however many distinct jobs are polled."""

from __future__ import annotations

import inspect
import threading
from datetime import datetime, timedelta
from typing import Annotated, Any

import pytest
from fastapi import FastAPI, Path, Query
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from httpx import Response
from pydantic import BaseModel
from sqlalchemy import column, insert, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError
from sqlmodel import Session, col, select
from starlette.routing import Mount, Route

from service.api.deps import AUTHORIZATION, PolledRoute
from service.api.driver_read import TIMES_KEPT, DriverRead
from service.api.fragments import Fragments
from service.api.reader import LedgerReader
from service.api.routes import jobs as jobs_routes
from service.api.routes.jobs import JobParams, ListParams
from service.app import ROUTERS, create_app
from service.config import Settings
from service.ledger.clock import CLOCK_ROW, read_version_on
from service.ledger.db import write_scope
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job, JobPublic
from tests.conftest import Login
from tests.support import get_job, run_async, runtime_of, submit, wait_state

JOBS = "/api/v1/jobs"


def set_step(api: TestClient, job_id: int, step: int) -> None:
    with write_scope(runtime_of(api).engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.progress = {"step": step, "total": 1000}
        session.add(job)


def test_a_committed_change_is_never_served_stale(api: TestClient) -> None:
    """A writer commits step after step; every answer begun after a commit shows that step or a later one,
    on the list, the single-job read and its revalidation, while renderings of older steps are kept."""
    job_id = submit(api, name="busy")["id"]
    other = submit(api, name="quiet")["id"]
    set_step(api, job_id, 0)
    committed = 0
    done = threading.Event()

    def writer() -> None:
        nonlocal committed
        for step in range(1, 200):
            set_step(api, job_id, step)
            committed = step  # after COMMIT: any read that starts now must see this step
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    tag, seen_step = "", -1
    reads = 0
    try:
        while not done.is_set():
            floor = committed
            single = api.get(f"{JOBS}/{job_id}", headers={"If-None-Match": tag} if tag else {})
            if single.status_code == 304:  # the tag it had still names the job's current version
                assert floor <= seen_step
            else:
                assert single.status_code == 200
                seen_step, tag = single.json()["progress"]["step"], single.headers["etag"]
                assert seen_step >= floor
            page = {item["id"]: item for item in api.get(JOBS).json()["items"]}
            assert page[job_id]["progress"]["step"] >= floor
            reads += 1
    finally:
        thread.join()
    assert reads > 10
    assert get_job(api, job_id)["progress"]["step"] == 199
    assert [item["progress"]["step"] for item in api.get(JOBS).json()["items"] if item["id"] == job_id] == [
        199
    ]
    assert get_job(api, other)["name"] == "quiet"


def test_a_rendering_kept_for_one_user_never_reaches_another(api: TestClient, login: Login) -> None:
    alices = submit(api, name="alices")["id"]
    mine = api.get(f"{JOBS}/{alices}")
    api.get(JOBS)
    assert runtime_of(api).fragments.size()[0] >= 1  # alice's job is rendered and kept
    bob = login("bob")
    bob_job = api.post(
        JOBS, json={"name": "bob-only", "entrypoint": "worker.tasks.seed:ddp_step"}, headers=bob
    )
    assert bob_job.status_code == 201

    assert api.get(f"{JOBS}/{alices}", headers=bob).status_code == 404
    revalidated = api.get(f"{JOBS}/{alices}", headers={**bob, "If-None-Match": mine.headers["etag"]})
    assert revalidated.status_code == 404  # not a 304 that would confirm the job exists
    assert [item["name"] for item in api.get(JOBS, headers=bob).json()["items"]] == ["bob-only"]
    for query in (
        "?name=alices",
        f"?limit=1&cursor={api.get(JOBS, params={'limit': 1}).json()['next_cursor']}",
    ):
        assert "alices" not in api.get(JOBS + query, headers=bob).text
    admin = login("root", admin=True)
    assert {item["name"] for item in api.get(JOBS, headers=admin).json()["items"]} == {"alices", "bob-only"}


def test_what_is_kept_stays_bounded_with_100_000_distinct_jobs_polled(api: TestClient) -> None:
    runtime = runtime_of(api)
    runtime.fragments = Fragments(max_bytes=4 * 2**20)  # well under 100,000 renderings (~60 MiB)
    now = utcnow()
    rows = [
        {
            "name": f"job-{n}",
            "owner": "alice",
            "backend": "local",
            "state": "succeeded",
            "spec": {"entrypoint": "worker.tasks.seed:ddp_step", "resources": {"nodes": 1}},
            "attempt": 1,
            "progress_offset": 0,
            "cancel_requested": False,
            "progress": {"step": 100, "total": 100, "metrics": {"loss": 0.1}},
            "created_at": now,
            "updated_at": now,
        }
        for n in range(100_000)
    ]
    with runtime.engine.begin() as connection:
        for start in range(0, len(rows), 10_000):
            connection.execute(insert(Job), rows[start : start + 10_000])

    seen: set[int] = set()
    cursor = None
    while True:
        page = api.get(JOBS, params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
        seen.update(item["id"] for item in page["items"])
        if page["next_cursor"] is None:
            break
        cursor = page["next_cursor"]
    for job_id in range(1, 100_001, 97):  # single reads of jobs all over the ledger
        assert api.get(f"{JOBS}/{job_id}").status_code == 200

    kept, kept_bytes = runtime.fragments.size()
    assert len(seen) == 100_000
    assert kept_bytes <= 4 * 2**20 and 0 < kept < 10_000
    assert runtime.fragments.misses >= 100_000  # every job was rendered once, most were let go


def insert_finished(api: TestClient, owner: str, count: int) -> list[int]:
    """`count` finished jobs of `owner`, oldest first: nothing moves them but the test (their folders
    count as measured, or housekeeping would restamp them)."""
    now = utcnow()
    row = {
        "owner": owner,
        "backend": "local",
        "state": "succeeded",
        "folder_bytes": 0,
        "spec": {"entrypoint": "worker.tasks.seed:ddp_step", "resources": {"nodes": 1}},
        "attempt": 1,
        "progress_offset": 0,
        "cancel_requested": False,
        "created_at": now,
        "updated_at": now,
    }
    with runtime_of(api).engine.begin() as connection:
        inserted = connection.execute(
            insert(Job).returning(col(Job.id)),
            [{**row, "name": f"{owner}-{n}"} for n in range(count)],
        )
        return sorted(job_id for (job_id,) in inserted if job_id is not None)


def revalidate(api: TestClient, url: str, tag: str, headers: dict[str, str] | None = None) -> Response:
    answer: Response = api.get(url, headers={**(headers or {}), "If-None-Match": tag})
    return answer


def test_a_list_tag_follows_the_jobs_on_its_page_not_the_ledger_clock(api: TestClient) -> None:
    ids = insert_finished(api, "alice", 4)
    url = f"{JOBS}?limit=2"  # the two newest: ids[3], ids[2]
    first = api.get(url)
    tag = first.headers["etag"]
    assert [item["id"] for item in first.json()["items"]] == [ids[3], ids[2]]

    engine = runtime_of(api).engine
    with engine.connect() as connection:
        clock = read_version_on(connection)
    set_step(api, ids[0], 1)  # a job off the page changes: the clock moves, the page does not
    with engine.connect() as connection:
        assert read_version_on(connection).seq > clock.seq
    assert revalidate(api, url, tag).status_code == 304

    set_step(api, ids[3], 1)  # a job on the page changes
    changed = revalidate(api, url, tag)
    assert changed.status_code == 200 and changed.headers["etag"] != tag
    assert changed.json()["items"][0]["progress"]["step"] == 1
    tag = changed.headers["etag"]
    assert revalidate(api, url, tag).status_code == 304

    with write_scope(runtime_of(api).engine) as session:  # a job on the page is deleted
        session.delete(session.get(Job, ids[2]))
    gone = revalidate(api, url, tag)
    assert gone.status_code == 200 and gone.headers["etag"] != tag
    assert [item["id"] for item in gone.json()["items"]] == [ids[3], ids[1]]


def test_a_list_tag_never_revalidates_another_viewers_page(api: TestClient, login: Login) -> None:
    insert_finished(api, "alice", 3)
    alices = api.get(JOBS)
    bob, carol, admin = login("bob"), login("carol"), login("root", admin=True)
    # The admin's page holds the very jobs alice's does, bob's none of them: neither is hers.
    for viewer in (bob, admin):
        answer = revalidate(api, JOBS, alices.headers["etag"], viewer)
        assert answer.status_code == 200 and answer.headers["etag"] != alices.headers["etag"]
    assert revalidate(api, JOBS, api.get(JOBS, headers=bob).headers["etag"], carol).status_code == 200
    assert [item["name"] for item in api.get(JOBS, headers=admin).json()["items"]] == [
        item["name"] for item in alices.json()["items"]
    ]


def test_the_polled_routes_document_the_headers_they_read() -> None:
    """list_jobs and get_job read Authorization and If-None-Match from the request (not declared to
    FastAPI, which checks declared headers on every request): the schema still shows both."""
    paths = create_app(Settings()).openapi()["paths"]
    for path in (JOBS, f"{JOBS}/{{job_id}}", f"{JOBS}/{{job_id}}/events"):
        headers = {p["name"]: p for p in paths[path]["get"]["parameters"] if p["in"] == "header"}
        assert set(headers) == {"authorization", "if-none-match"}, path
        assert headers["authorization"]["description"] == AUTHORIZATION
        assert headers["if-none-match"]["schema"]["title"] == "If-None-Match"


def test_the_polled_routes_document_their_parameters_as_fastapi_would() -> None:
    """list_jobs and get_job validate their parameters with one model each (deps.read_params); the
    schema shows them exactly as FastAPI shows the same fields declared one by one."""

    def declared(params: type[BaseModel], path: str) -> list[dict[str, Any]]:
        """The parameters FastAPI documents for the model's fields declared as route parameters."""
        twin = FastAPI()
        signature = []
        for name, field in params.model_fields.items():
            place = Path if f"{{{name}}}" in path else Query
            markers = (field.annotation, *field.metadata, place(description=field.description))
            annotation = Annotated.__class_getitem__(markers)  # type: ignore[attr-defined]
            default = inspect.Parameter.empty if field.is_required() else field.default
            signature.append(
                inspect.Parameter(
                    name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default
                )
            )

        def endpoint(**_: Any) -> None:
            return None

        endpoint.__signature__ = inspect.Signature(signature)  # type: ignore[attr-defined]
        twin.get(path)(endpoint)
        parameters: list[dict[str, Any]] = twin.openapi()["paths"][path]["get"]["parameters"]
        return parameters

    paths = create_app(Settings()).openapi()["paths"]
    for path, params in ((JOBS, ListParams), (f"{JOBS}/{{job_id}}", JobParams)):
        served = [p for p in paths[path]["get"]["parameters"] if p["in"] != "header"]
        assert served == declared(params, path), path


def test_the_app_matches_its_routes_in_one_flat_list_polled_routes_first() -> None:
    """create_app puts the routers' routes on the app's router itself (service.app.ROUTERS says
    why): no route is a router to resolve, the polled ones are matched first, and the API schema
    is the one include_router gives the same routers."""
    app = create_app(Settings())
    assert all(isinstance(route, (APIRoute, Route, Mount)) for route in app.router.routes)
    paths = [getattr(route, "path", None) for route in app.router.routes]
    assert paths[:3] == [JOBS, JOBS, f"{JOBS}/{{job_id}}"]
    included = FastAPI()
    for router in ROUTERS:
        included.include_router(router)
    assert app.openapi()["paths"] == included.openapi()["paths"]
    assert app.openapi()["components"] == included.openapi()["components"]


def test_the_polled_routes_are_called_without_fastapis_request_handler() -> None:
    """deps.PolledRoute: an endpoint taking only the Request is the route's handler itself; a route
    with parameters or dependencies keeps FastAPI's."""
    routes = {route.endpoint: route for route in jobs_routes.router.routes if isinstance(route, APIRoute)}
    for direct in (jobs_routes.list_jobs, jobs_routes.get_job):
        assert routes[direct].get_route_handler() is direct
    solved: list[Any] = [jobs_routes.create_job, jobs_routes.get_events, jobs_routes.cancel_job]
    for endpoint in solved:
        route = routes[endpoint]
        assert isinstance(route, PolledRoute) and route.get_route_handler() is not endpoint


@pytest.mark.parametrize(
    ("url", "loc"),
    [
        (f"{JOBS}?limit=0", ["query", "limit"]),
        (f"{JOBS}?limit=ten", ["query", "limit"]),
        (f"{JOBS}?state=running&state=bogus", ["query", "state", 1]),
        (f"{JOBS}?name=ab", ["query", "name"]),
        (f"{JOBS}?since=1700000000", ["query", "since"]),
        (f"{JOBS}/0", ["path", "job_id"]),
        (f"{JOBS}/abc", ["path", "job_id"]),
        (f"{JOBS}/1?wait_s=-1", ["query", "wait_s"]),
        (f"{JOBS}/1?wait_s=31", ["query", "wait_s"]),
    ],
)
def test_a_bad_parameter_of_a_polled_route_is_a_422_naming_it(
    api: TestClient, url: str, loc: list[Any]
) -> None:
    answer = api.get(url)
    assert answer.status_code == 422, answer.text
    assert [problem["loc"] for problem in answer.json()["detail"]] == [loc]


def test_the_polled_routes_read_repeated_parameters_as_fastapi_does(api: TestClient) -> None:
    """A list takes every value, a scalar the last one; a parameter no route knows is ignored."""
    first, second = submit(api)["id"], submit(api)["id"]
    cancelled = api.post(f"{JOBS}/{first}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    # A job the dispatcher took already is cancelled once the backend has stopped it, a tick later.
    wait_state(api, first, "cancelled")
    # the second job moves on meanwhile (the fake backend takes it): every state it may be in
    active = [("state", state) for state in ("queued", "submitted", "pending", "running")]
    both = api.get(JOBS, params=[("state", "cancelled"), *active])
    assert {job["id"] for job in both.json()["items"]} >= {first, second}
    only = api.get(JOBS, params=[("state", "cancelled")])
    assert [job["id"] for job in only.json()["items"]] == [first]
    last = api.get(JOBS, params=[("limit", "5"), ("limit", "1"), ("unknown", "x")])
    assert last.status_code == 200 and len(last.json()["items"]) == 1


def test_the_readers_driver_read_answers_as_sqlalchemy_does(api: TestClient) -> None:
    """The clock, run on the driver's cursor (service.api.reader.DriverRead): the same values,
    converted the same way (an aware datetime), and a driver error as SQLAlchemy's."""
    engine = runtime_of(api).engine
    submit(api)
    with engine.connect() as connection:
        # the fake backend moves the job on meanwhile, and each move ticks the clock: compare a
        # driver read with SQLAlchemy's reads just before and just after it when those two agree
        for _ in range(100):
            before = connection.execute(CLOCK_ROW).first()
            connection.rollback()
            got = DriverRead(CLOCK_ROW, engine.dialect).first(connection)
            after = connection.execute(CLOCK_ROW).first()
            connection.rollback()
            if before == after:
                break
        assert before is not None and before == after and got == tuple(before)
        assert got[1].tzinfo is not None
        connection.connection.driver_connection.close()  # type: ignore[union-attr]
        with pytest.raises(DBAPIError):
            DriverRead(CLOCK_ROW, engine.dialect).first(connection)
        connection.invalidate()


def test_the_reader_reads_again_on_a_new_connection_when_its_own_broke(engine: Engine) -> None:
    """A database restart drops the reader's connections: its next read is made on a new one. The
    driver's errors are SQLAlchemy's (DBAPIError; an OperationalError is a 503, as everywhere else)."""
    reader = LedgerReader(engine)

    async def scenario() -> None:
        first = await reader.clock()
        assert first.stamped_at.tzinfo is not None
        if engine.dialect.name == "postgresql":
            with engine.connect() as connection:  # every other connection of this database, ended
                connection.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    )
                )
        else:
            reader._on_loop._connect().connection.driver_connection.close()  # type: ignore[union-attr]
        assert await reader.clock() == first
        with pytest.raises(DBAPIError):
            await reader._fetch(reader._driver_read(select(column("nothing_is_called_this"))), {})

    try:
        run_async(scenario())
    finally:
        reader.close()


def test_a_job_is_rendered_from_its_columns_as_from_its_orm_object(api: TestClient) -> None:
    """The reader renders a job from its columns (service.domain.jobs.job_reads), not from a Job: the
    same JSON as JobPublic of the ORM's Job, every JSON column, time and enum included."""
    job_id = submit(api, name="columns", retries={"max": 3, "backoff_s": 1, "on": ["preemption"]})["id"]
    with write_scope(runtime_of(api).engine) as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.progress = {"step": 7, "total": 10, "loss": 0.25}
        job.placement = [{"rank": 0, "host": "n1", "local_rank": 0, "gpu": None}]
        job.result = [1, {"a": None}]
        job.started_at = utcnow()
        job.cancel_requested = True
        session.add(job)
    compared = set()
    for _ in range(100):  # the fake backend moves the job on: compare answers of the version read
        with write_scope(runtime_of(api).engine) as session:  # no writes: the job as the ORM reads it now
            expected = JobPublic.model_validate(session.get(Job, job_id), from_attributes=True)
        want = expected.model_dump(mode="json")
        for route, answer in (
            ("job", api.get(f"{JOBS}/{job_id}")),
            ("list", api.get(JOBS, params={"name": "columns"})),
        ):
            assert answer.status_code == 200, answer.text
            got = answer.json()["items"][0] if route == "list" else answer.json()
            if got["updated_at"] == want["updated_at"]:
                assert got == want
                compared.add(route)
        if compared == {"job", "list"}:
            return
    raise AssertionError(f"the job never stood still long enough to compare: {compared}")



def test_a_time_read_again_is_converted_once_and_at_most_so_many_are_kept(engine: Engine) -> None:
    """DriverRead converts each distinct stored time once (SQLite hands times back as text), while it
    is among the TIMES_KEPT most recently read: the aware datetime SQLAlchemy makes, and memory
    bounded whatever the number of distinct times polled."""
    for n in range(3):  # each commit stamps its job with the ledger clock's time
        with Session(engine) as session:
            session.add(Job(name=f"t{n}", backend="local", spec={}))
            session.commit()
    statement = select(col(Job.updated_at)).order_by(col(Job.id))
    read = DriverRead(statement, engine.dialect)
    with engine.connect() as connection:
        first = [row[0] for row in read.all(connection, {})]
        again = [row[0] for row in read.all(connection, {})]
        expected = [row[0] for row in connection.execute(statement)]
    assert first == expected and len(set(first)) == 3 and all(stamp.tzinfo is not None for stamp in first)
    assert all(one is other for one, other in zip(first, again, strict=True))

    def as_stored(stamp: datetime) -> object:
        """What the driver hands back for this time, a new object each call."""
        if engine.dialect.name == "sqlite":
            return stamp.strftime("%Y-%m-%d %H:%M:%S.%f")
        return stamp + timedelta(0)

    for n in range(TIMES_KEPT):  # as many other times push the first one out
        read.converted((as_stored(first[0] + timedelta(microseconds=n + 1)),))
    (converted_again,) = read.converted((as_stored(first[0]),))
    assert converted_again == first[0] and converted_again is not first[0]
