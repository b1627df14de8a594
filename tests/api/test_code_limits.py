"""What one user's code uploads may take of a shared service: bytes stored (403 naming `archive`),
uploads a minute (shared with job submissions: 429), and a full data directory (507), each refused
before anything is written. Real ledger, fake backends."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from fastapi.testclient import TestClient
from httpx import Response
from sqlmodel import Session, select

from service.app import create_app
from service.config import Settings
from service.domain import code_store
from service.ledger.models.code_snapshots import CodeSnapshot
from tests.api.test_code import CODE, GZIP, message, pack_text
from tests.fakes import FakeBackend
from tests.support import JOBS, bearer, issue_token, runtime_of


@contextmanager
def coder_client(settings: Settings, **limits: object) -> Iterator[TestClient]:
    """A service with these settings changed, and a client with a coder's token."""
    with TestClient(
        create_app(settings.model_copy(update=limits), backends={"local": FakeBackend("local")})
    ) as client:
        client.headers.update(bearer(issue_token(runtime_of(client).engine, "carol", allow_code=True)))
        yield client


def upload(client: TestClient, data: bytes, headers: dict[str, str] | None = None) -> Response:
    return client.post(CODE, content=data, headers={**GZIP, **(headers or {})})


def stored_files(client: TestClient) -> set[str]:
    root = code_store.store_root(runtime_of(client).settings)
    return {path.name for path in root.iterdir()} if root.exists() else set()


def held_by(client: TestClient, owner: str) -> int:
    with Session(runtime_of(client).engine) as session:
        rows = session.exec(select(CodeSnapshot).where(CodeSnapshot.owner == owner)).all()
    return sum(row.bytes + row.unpacked_bytes for row in rows)


def cost(data: bytes) -> int:
    """What a snapshot counts against its owner: its archive and its files unpacked."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return len(data) + sum(member.size for member in tar)


def test_a_users_snapshots_are_limited_in_bytes(settings: Settings) -> None:
    one, two, three = pack_text("one"), pack_text("two"), pack_text("three")
    most = cost(one) + cost(two) + cost(three) - 1
    with coder_client(settings, max_code_bytes_per_user=most) as client:
        first = upload(client, one)
        second = upload(client, two)
        before = stored_files(client)
        over = upload(client, three)
        after = stored_files(client)
        again = upload(client, one)  # theirs already: stores nothing, so it fits
        dave = bearer(issue_token(runtime_of(client).engine, "dave", allow_code=True))
        other = upload(client, three, dave)  # the limit is carol's, not everyone's

        assert (first.status_code, second.status_code) == (201, 201)
        assert over.status_code == 403, over.text
        assert over.json()["detail"][0]["loc"] == ["body", "archive"]
        held = cost(one) + cost(two)
        assert f"your code snapshots hold {held} bytes" in message(over)
        assert f"{cost(three)} more would pass your limit of {most} bytes" in message(over)
        assert "TORCHYARD_MAX_CODE_BYTES_PER_USER" in message(over)
        assert after == before  # nothing written for the refused one
        assert again.status_code == 200, again.text
        assert other.status_code == 201, other.text
        assert held_by(client, "carol") == held


def test_the_per_user_limit_defaults_to_a_multiple_of_the_largest_upload(settings: Settings) -> None:
    default = settings.model_copy(update={"max_code_bytes": 2**20})
    assert default.code_bytes_per_user() == 16 * 2**20
    assert default.model_copy(update={"max_code_bytes_per_user": 5000}).code_bytes_per_user() == 5000


def test_simultaneous_uploads_cannot_pass_the_limit_together(settings: Settings) -> None:
    candidates = [pack_text(f"file number {i:02}") for i in range(40)]
    size = max(map(len, candidates), key=[len(one) for one in candidates].count)  # the commonest size
    archives = [one for one in candidates if len(one) == size][:8]
    assert len(archives) == 8
    most = 3 * cost(archives[0]) - 1  # room for two of them (their files are of one size too)
    with coder_client(settings, max_code_bytes_per_user=most, max_uploads_in_flight_per_user=8) as client:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda data: upload(client, data), archives))

        assert sorted(answer.status_code for answer in answers) == [201] * 2 + [403] * 6
        assert held_by(client, "carol") <= most


def test_uploads_count_against_the_submissions_of_the_minute(settings: Settings) -> None:
    with coder_client(settings, max_submissions_per_minute=3) as client:
        answers = [upload(client, pack_text("same")) for _ in range(3)]
        over = upload(client, pack_text("other"))
        job = client.post(JOBS, json={"name": "j", "entrypoint": "worker.tasks.seed:ddp_step"})

        assert [answer.status_code for answer in answers] == [201, 200, 200]
        assert over.status_code == 429, over.text
        assert "3 submissions per minute" in message(over) and "code uploads" in message(over)
        assert 1 <= int(over.headers["Retry-After"]) <= 60
        assert job.status_code == 429  # one limit for jobs and uploads
        assert held_by(client, "carol") == answers[0].json()["bytes"] + answers[0].json()["unpacked_bytes"]


def test_an_upload_to_a_full_data_directory_is_507_and_writes_nothing(settings: Settings) -> None:
    with coder_client(settings, min_free_disk_mb=2**40) as client:
        full = upload(client, pack_text("no room"))

        assert full.status_code == 507, full.text
        assert "MB free" in message(full)
        assert stored_files(client) == set() and held_by(client, "carol") == 0
