"""Code snapshots cost their owner, not the house (issue 43, findings 4 and 6): one unpacked copy per
snapshot shared by its jobs, its bytes counted against the uploader, unpacked off the dispatch thread,
and upload bodies streamed to disk with a cap on the uploads in flight. Real ledger, fake backends."""

from __future__ import annotations

import asyncio
import os
import tarfile
import threading
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from service.domain import code_copies
from tests.api.test_code import CODE, GZIP, message, tar_gz
from tests.fakes import FakeBackend
from tests.support import JOBS, bearer, issue_token, runtime_of, wait_for

UNPACKED = 2 * 2**20  # what the small archive's one file takes unpacked


def small_archive_of_big_files(text: str = "") -> bytes:
    """A few KB of archive whose file unpacks to UNPACKED bytes (zeros compress well)."""
    info = tarfile.TarInfo("train.py")
    content = f"# {text}\n".encode().ljust(UNPACKED, b"\0")
    info.size = len(content)
    return tar_gz((info, content))


def bytes_under(folder: Path) -> int:
    """Every regular file's bytes below `folder`, each counted once (links not followed)."""
    total = 0
    for root, _, names in os.walk(folder):
        for name in names:
            info = os.lstat(os.path.join(root, name))
            total += info.st_size if not os.path.islink(os.path.join(root, name)) else 0
    return total


@pytest.fixture
def coder_api(settings: Settings, fake: FakeBackend) -> Iterator[TestClient]:
    with TestClient(create_app(settings, backends={"local": fake})) as client:
        client.headers.update(bearer(issue_token(runtime_of(client).engine, "carol", allow_code=True)))
        yield client


def submit(client: TestClient, code_id: str | None, headers: dict[str, str] | None = None) -> int:
    spec: dict[str, Any] = {"name": "c", "entrypoint": "worker.tasks.seed:ddp_step"}
    if code_id is not None:
        spec.update(code=code_id, entrypoint="train:main")
    answer = client.post(JOBS, json=spec, headers=headers or {})
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def state_of(client: TestClient, job_id: int, headers: dict[str, str] | None = None) -> dict[str, Any]:
    found: dict[str, Any] = client.get(f"{JOBS}/{job_id}", headers=headers or {}).json()
    return found


# ---------------------------------------------------------------- finding 4: disk, quota, dispatch thread


def test_sixteen_jobs_of_one_small_archive_share_one_unpacked_copy(coder_api: TestClient) -> None:
    archive = small_archive_of_big_files()
    assert len(archive) < 16 * 1024
    code_id = coder_api.post(CODE, content=archive, headers=GZIP).json()["id"]
    data_dir = runtime_of(coder_api).settings.data_dir
    before = bytes_under(data_dir)

    jobs = [submit(coder_api, code_id) for _ in range(16)]
    for job_id in jobs:
        wait_for(
            lambda j=job_id: state_of(coder_api, j)["state"] != "queued", what=f"job {job_id} dispatched"
        )
    grown = bytes_under(data_dir) - before

    assert UNPACKED <= grown < 2 * UNPACKED, f"{grown} bytes for 16 jobs: one copy is {UNPACKED}"
    folders = {Path(state_of(coder_api, job_id)["folder"]) for job_id in jobs}
    assert len({(folder / "code").resolve() for folder in folders}) == 1  # every job's code: one copy
    assert all((folder / "code").is_symlink() for folder in folders)


def test_the_unpacked_bytes_count_against_the_uploaders_limit(settings: Settings) -> None:
    limited = settings.model_copy(update={"max_code_bytes_per_user": UNPACKED // 2})
    with TestClient(create_app(limited, backends={"local": FakeBackend("local")})) as client:
        carol = bearer(issue_token(runtime_of(client).engine, "carol", allow_code=True))
        archive = small_archive_of_big_files()
        assert len(archive) < UNPACKED // 2  # the archive alone fits

        over = client.post(CODE, content=archive, headers={**carol, **GZIP})

    assert over.status_code == 403, over.text
    assert over.json()["detail"][0]["loc"] == ["body", "archive"]
    assert f"{len(archive) + UNPACKED} more would pass your limit" in message(over)
    assert "unpacked" in message(over) and "TORCHYARD_MAX_CODE_BYTES_PER_USER" in message(over)


def test_another_users_job_is_not_held_while_one_users_code_is_unpacked(
    coder_api: TestClient, fake: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake slow unpack (held until the test lets it go): dave's job goes at once, carol's wait in
    the queue saying why, and carol's second snapshot waits for her first (one at a time per user)."""
    release, started = threading.Event(), []
    real_unpack = code_copies.unpack

    def slow_unpack(tar: tarfile.TarFile, building: Path, deadline: float = float("inf")) -> None:
        started.append(building)
        assert release.wait(30), "the test never let the unpack go"
        real_unpack(tar, building, deadline)

    monkeypatch.setattr(code_copies, "unpack", slow_unpack)
    first = coder_api.post(CODE, content=small_archive_of_big_files("one"), headers=GZIP).json()["id"]
    second = coder_api.post(CODE, content=small_archive_of_big_files("two"), headers=GZIP).json()["id"]
    carols = [submit(coder_api, first), submit(coder_api, first), submit(coder_api, second)]
    wait_for(lambda: started, what="carol's first unpack to start")
    dave = bearer(issue_token(runtime_of(coder_api).engine, "dave"))

    daves = submit(coder_api, None, dave)
    wait_for(
        lambda: state_of(coder_api, daves, dave)["state"] != "queued", timeout=5, what="dave's job going"
    )

    waiting = [state_of(coder_api, job_id) for job_id in carols]
    assert [job["state"] for job in waiting] == ["queued"] * 3
    assert all("unpacked" in (job["reason"] or "") for job in waiting), waiting
    assert len(started) == 1  # carol's second snapshot waits for her first
    assert runtime_of(coder_api).dispatcher.last_duration_s < 5  # no tick waits for an unpack
    release.set()
    for job_id in carols:
        wait_for(lambda j=job_id: state_of(coder_api, j)["state"] != "queued", what=f"carol's job {job_id}")
    assert len(started) == 2


# ---------------------------------------------------------------- finding 6: memory, uploads in flight


def random_archive(size: int) -> bytes:
    info = tarfile.TarInfo("data.bin")
    info.size = size
    return tar_gz((info, os.urandom(size)))


async def chunks_of(data: bytes, size: int = 64 * 1024) -> AsyncIterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), size):
        yield bytes(view[start : start + size])
        await asyncio.sleep(0)  # let the other uploads interleave


def test_concurrent_uploads_do_not_hold_their_bodies_in_memory(settings: Settings) -> None:
    """Eight users upload 2 MiB each at once through the ASGI app, in 64 KiB chunks as a socket
    gives them: the request path's peak memory stays far below the bodies' 16 MiB."""
    users, body = 8, 2 * 2**20
    archives = [random_archive(body) for _ in range(users)]
    app = create_app(settings, backends={"local": FakeBackend("local")})

    async def upload_all() -> tuple[list[int], int]:
        async with app.router.lifespan_context(app):
            engine = app.state.runtime.engine
            tokens = [bearer(issue_token(engine, f"user{i}", allow_code=True)) for i in range(users)]
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                tracemalloc.start()
                try:
                    answers = await asyncio.gather(
                        *(
                            client.post(CODE, content=chunks_of(data), headers={**token, **GZIP})
                            for data, token in zip(archives, tokens, strict=True)
                        )
                    )
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
        return [answer.status_code for answer in answers], peak

    codes, peak = asyncio.run(upload_all())

    assert codes == [201] * users
    assert peak < users * body / 4, f"peak {peak / 2**20:.1f} MiB for {users} bodies of {body / 2**20} MiB"


def test_uploads_in_flight_are_capped_per_user_and_in_all_with_429(settings: Settings) -> None:
    """Carol's two uploads hold their places (their bodies still coming): her third is 429 at once,
    with Retry-After, naming her limit; dave's is not hers to count, and holds the last of the
    service's three places, so erin's is 429 naming the service's limit."""
    app = create_app(
        settings.model_copy(update={"max_uploads_in_flight": 3}), {"local": FakeBackend("local")}
    )
    archive = random_archive(1024)

    async def held_body(gate: asyncio.Event) -> AsyncIterator[bytes]:
        yield archive[:100]
        await gate.wait()
        yield archive[100:]

    async def uploads() -> list[httpx.Response]:
        async with app.router.lifespan_context(app):
            engine = app.state.runtime.engine
            carol, dave, erin = (
                bearer(issue_token(engine, user, allow_code=True)) for user in ("carol", "dave", "erin")
            )
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                gate = asyncio.Event()

                async def hold(
                    headers: dict[str, str], user: str, count: int
                ) -> asyncio.Task[httpx.Response]:
                    task = asyncio.create_task(
                        client.post(CODE, content=held_body(gate), headers={**headers, **GZIP})
                    )
                    for _ in range(1000):  # until it holds its place (the event loop is ours)
                        if app.state.runtime.code_uploads.in_flight(user) == count:
                            break
                        await asyncio.sleep(0.005)
                    else:
                        pytest.fail(f"{user}'s upload {count} never took its place in flight")
                    return task

                held = [await hold(carol, "carol", 1), await hold(carol, "carol", 2)]
                third = await client.post(CODE, content=archive, headers={**carol, **GZIP})
                held.append(await hold(dave, "dave", 1))
                erins = await client.post(CODE, content=archive, headers={**erin, **GZIP})
                gate.set()
                return [third, erins, *(await asyncio.gather(*held))]

    third, erins, *held = asyncio.run(uploads())

    assert third.status_code == 429, third.text
    assert "TORCHYARD_MAX_UPLOADS_IN_FLIGHT_PER_USER" in message(third) and "limit is 2" in message(third)
    assert int(third.headers["Retry-After"]) >= 1
    assert erins.status_code == 429, erins.text
    assert "TORCHYARD_MAX_UPLOADS_IN_FLIGHT)" in message(erins) and "limit is 3" in message(erins)
    assert sorted(answer.status_code for answer in held) == [200, 201, 201]  # carol's twice, dave's
