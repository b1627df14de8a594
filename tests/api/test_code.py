"""POST /api/v1/code and a job's `code` and `python`: archive checks (nothing written outside the
store), dedupe, ownership, the allow-code permission, allowed interpreters. Real ledger, fake backends."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, select

from service.app import create_app
from service.code_pack import pack
from service.config import Settings
from service.domain import code_store
from service.ledger.db import session_scope
from service.ledger.models.code_snapshots import CodeSnapshot
from tests.fakes import FakeBackend
from tests.support import JOBS, bearer, issue_token, runtime_of

CODE = "/api/v1/code"
GZIP = {"Content-Type": "application/gzip"}


def tar_gz(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    """The same bytes for the same members (no time in the gzip header): the same snapshot id."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for info, content in members:
            if content is not None:
                info.size = len(content)
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return gzip.compress(out.getvalue(), mtime=0)


def member(name: str, kind: bytes = tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, link
    return info


def a_zip(name: str, content: bytes, mode: int = 0o100644) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        info = zipfile.ZipInfo(name)
        info.external_attr = mode << 16
        archive.writestr(info, content)
    return out.getvalue()


def project() -> bytes:
    return tar_gz(
        (member("train.py"), b"def main(ctx):\n    return 1\n"),
        (member("model", tarfile.DIRTYPE), None),
        (member("model/net.py"), b"X = 1\n"),
        (member("latest", tarfile.SYMTYPE, "model/net.py"), None),
    )


def message(response: Any) -> str:
    return " ".join(str(item["msg"]) for item in response.json()["detail"])


@pytest.fixture
def coder(api: TestClient) -> dict[str, str]:
    """Headers of a user with the allow-code permission."""
    return bearer(issue_token(runtime_of(api).engine, "carol", allow_code=True))


def every_path(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


# ---------------------------------------------------------------- uploads


def test_an_upload_is_stored_once_by_its_sha256(api: TestClient, coder: dict[str, str]) -> None:
    data = project()
    first = api.post(CODE, content=data, headers={**coder, **GZIP})
    again = api.post(CODE, content=data, headers={**coder, **GZIP})

    assert first.status_code == 201, first.text
    assert again.status_code == 200
    digest = hashlib.sha256(data).hexdigest()
    assert first.json()["id"] == again.json()["id"] == f"sha256:{digest}"
    assert first.json()["bytes"] == len(data) and first.json()["files"] == 3
    store = code_store.store_root(runtime_of(api).settings)
    assert sorted(p.name for p in store.iterdir()) == [f"{digest}.json", f"{digest}.tar.gz"]
    detail = api.get(f"{CODE}/sha256:{digest}", headers=coder).json()
    assert detail["paths"] == ["latest", "model/net.py", "train.py"]


def test_an_upload_is_committed_before_its_answer_is_sent(api: TestClient, coder: dict[str, str]) -> None:
    """A client submits a job naming the snapshot the moment the upload answers: the snapshot must be
    in the ledger by then (FastAPI ends a plain yield dependency only after the response is sent)."""
    stored_when_answered: list[int] = []

    async def watching(scope: Any, receive: Any, send: Any) -> None:
        async def send_watched(message: Any) -> None:
            if message["type"] == "http.response.start" and scope["path"] == CODE:
                with Session(runtime_of(api).engine) as session:
                    stored_when_answered.append(len(session.exec(select(CodeSnapshot)).all()))
            await send(message)

        await api.app(scope, receive, send_watched)

    response = TestClient(watching).post(CODE, content=project(), headers={**coder, **GZIP})

    assert response.status_code == 201, response.text
    assert stored_when_answered == [1]


def test_a_zip_is_taken_and_stored_as_tar_gz(api: TestClient, coder: dict[str, str]) -> None:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("train.py", "def main(ctx):\n    return 2\n")
        archive.writestr("pkg/__init__.py", "")
    response = api.post(CODE, content=out.getvalue(), headers={**coder, "Content-Type": "application/zip"})

    assert response.status_code == 201, response.text
    stored = code_store.store_root(runtime_of(api).settings) / f"{response.json()['id'][7:]}.tar.gz"
    with tarfile.open(stored) as tar:
        assert sorted(tar.getnames()) == ["pkg/__init__.py", "train.py"]


BAD_ARCHIVES = {
    "traversal": (tar_gz((member("../../escaped.py"), b"x")), "leads out of the project"),
    "absolute path": (tar_gz((member("/tmp/escaped.py"), b"x")), "is an absolute path"),
    "link out": (tar_gz((member("out", tarfile.SYMTYPE, "../../../etc/passwd"), None)), "leads out"),
    "absolute link": (tar_gz((member("out", tarfile.SYMTYPE, "/etc/passwd"), None)), "absolute path"),
    "hard link": (tar_gz((member("a"), b"x"), (member("b", tarfile.LNKTYPE, "a"), None)), "hard link"),
    # Each link's text stays inside; followed on disk, `sub/l/m` (and `x`) lead to the project's parent.
    "path through a link": (
        tar_gz(
            (member("sub/l", tarfile.SYMTYPE, ".."), None), (member("sub/l/m", tarfile.SYMTYPE, ".."), None)
        ),
        "'sub/l/m' lies inside the link 'sub/l'",
    ),
    "link through a link": (
        tar_gz(
            (member("sub/up", tarfile.SYMTYPE, ".."), None), (member("x", tarfile.SYMTYPE, "sub/up/.."), None)
        ),
        "link 'x' leads through the link 'sub/up'",
    ),
    "a folder where a link was": (
        tar_gz(
            (member("d", tarfile.SYMTYPE, "e"), None),
            (member("d", tarfile.DIRTYPE), None),
            (member("e"), b"x"),
        ),
        "'d' is in the archive twice",
    ),
    "device": (tar_gz((member("dev", tarfile.CHRTYPE), None)), "device, FIFO"),
    "fifo": (tar_gz((member("pipe", tarfile.FIFOTYPE), None)), "device, FIFO"),
    "not an archive": (b"just some text, not an archive at all", "is not a .tar.gz, .tar or zip"),
    "cut short": (project()[:60], "damaged or cut short"),
    "empty": (tar_gz(), "holds no files"),
    "zip traversal": (a_zip("../escaped.py", b"x"), "leads out of the project"),
    "zip link out": (a_zip("out", b"../../etc/passwd", stat.S_IFLNK | 0o777), "leads out"),
    "zip fifo": (a_zip("pipe", b"", stat.S_IFIFO | 0o644), "device, FIFO"),
    "zip damaged": (a_zip("a.py", b"x" * 100).replace(b"x" * 100, b"y" * 100), "damaged"),
}


@pytest.mark.parametrize("case", BAD_ARCHIVES)
def test_bad_archives_are_refused_naming_the_problem_and_nothing_is_written(
    api: TestClient, coder: dict[str, str], tmp_path: Path, case: str
) -> None:
    data, problem = BAD_ARCHIVES[case]
    data_dir = runtime_of(api).settings.data_dir
    before = every_path(data_dir), every_path(tmp_path)

    response = api.post(CODE, content=data, headers={**coder, **GZIP})

    assert response.status_code == 422, response.text
    assert problem in message(response)
    assert response.json()["detail"][0]["loc"] == ["body", "archive"]
    assert (every_path(data_dir), every_path(tmp_path)) == before
    assert not Path("/tmp/escaped.py").exists()


def test_too_big_an_upload_is_413_naming_the_setting(settings: Settings, coder_app: TestClient) -> None:
    headers = {**coder_app.headers, **GZIP}
    declared = coder_app.post(CODE, content=b"x" * 5000, headers=headers)
    assert declared.status_code == 413
    assert "TORCHYARD_MAX_CODE_BYTES" in message(declared)

    def chunks() -> Any:  # no Content-Length: refused as it grows
        for _ in range(10):
            yield b"y" * 1000

    streamed = coder_app.post(CODE, content=chunks(), headers=headers)
    assert streamed.status_code == 413
    bomb = tar_gz((member("zeros.bin"), b"\0" * 20_000))  # 4 x 4096 unpacked at most
    assert len(bomb) < 4096
    unpacked = coder_app.post(CODE, content=bomb, headers=headers)
    assert unpacked.status_code == 422 and "unpack to more than 16384 bytes" in message(unpacked)
    assert not code_store.store_root(settings).exists()


@pytest.fixture
def coder_app(settings: Settings) -> Iterator[TestClient]:
    """A service with a 4 KiB code limit, and a client with a coder's token."""
    small = settings.model_copy(update={"max_code_bytes": 4096})
    with TestClient(create_app(small, backends={"local": FakeBackend("local")})) as client:
        client.headers.update(bearer(issue_token(runtime_of(client).engine, "carol", allow_code=True)))
        yield client


# ---------------------------------------------------------------- who may


def test_without_the_permission_an_upload_is_403(api: TestClient) -> None:
    response = api.post(CODE, content=project(), headers=GZIP)  # alice: a token without --allow-code
    assert response.status_code == 403
    assert "--allow-code" in message(response)
    assert not code_store.store_root(runtime_of(api).settings).exists()


def test_the_quota_row_overrides_the_token(api: TestClient, coder: dict[str, str]) -> None:
    from service.ledger.models.access import UserQuota

    runtime = runtime_of(api)
    with session_scope(runtime.engine) as session:
        session.add(UserQuota(username="carol", allow_code=False))
        session.add(UserQuota(username="alice", allow_code=True))
    runtime.tokens._known.clear()  # what the token cache held a moment ago

    assert api.post(CODE, content=project(), headers={**coder, **GZIP}).status_code == 403
    assert api.post(CODE, content=project(), headers=GZIP).status_code == 201


def test_another_users_code_is_404_and_theirs_once_they_upload_it(
    api: TestClient, coder: dict[str, str]
) -> None:
    code_id = api.post(CODE, content=project(), headers={**coder, **GZIP}).json()["id"]
    dave = bearer(issue_token(runtime_of(api).engine, "dave", allow_code=True))
    root = bearer(issue_token(runtime_of(api).engine, "root", admin=True))
    job = {"name": "theirs", "entrypoint": "train:main", "code": code_id}

    assert api.get(f"{CODE}/{code_id}", headers=dave).status_code == 404
    refused = api.post(JOBS, json=job, headers=dave)
    assert refused.status_code == 404 and refused.json()["detail"][0]["loc"] == ["body", "code"]
    assert api.get(f"{CODE}/{code_id}", headers=root).status_code == 200  # admins see every snapshot

    assert api.post(CODE, content=project(), headers={**dave, **GZIP}).status_code == 201  # new to dave
    assert api.post(JOBS, json=job, headers=dave).status_code == 201


# ---------------------------------------------------------------- jobs with code


def test_a_job_names_its_code_and_its_targets_are_checked_against_it(
    api: TestClient, coder: dict[str, str]
) -> None:
    code_id = api.post(CODE, content=project(), headers={**coder, **GZIP}).json()["id"]

    def post(**fields: Any) -> Any:
        return api.post(JOBS, json={"name": "c", "code": code_id, **fields}, headers=coder)

    accepted = post(entrypoint="train:main")
    assert accepted.status_code == 201, accepted.text
    assert accepted.json()["spec"]["code"] == code_id
    assert post(script="model/net.py").status_code == 201
    assert post(script="./train.py").status_code == 201
    missing = post(script="nope.py")
    assert missing.status_code == 422 and "not a file of the job's code snapshot" in message(missing)
    assert post(script="../train.py").status_code == 422
    outside = post(entrypoint="os:system")  # not in the snapshot: the allow-list still decides
    assert outside.status_code == 403 and outside.json()["detail"][0]["loc"] == ["body", "entrypoint"]
    assert post(entrypoint="worker.tasks.seed:ddp_step").status_code == 201
    not_an_id = post(code=".", entrypoint="train:main")
    assert not_an_id.status_code == 422 and not_an_id.json()["detail"][0]["loc"] == ["body", "code"]
    without = api.post(JOBS, json={"name": "c", "code": code_id, "entrypoint": "train:main"})
    assert without.status_code == 403  # alice may not run code, even code she can name


def test_interpreters_come_from_the_allowed_list(api: TestClient, tmp_path: Path) -> None:
    ours = runtime_of(api).settings.job_interpreter()
    assert api.post(JOBS, json={"name": "p", "entrypoint": "worker.tasks.seed:ddp_step", "python": ours}
                    ).status_code == 201  # fmt: skip
    other = api.post(JOBS, json={"name": "p", "entrypoint": "worker.tasks.seed:ddp_step",
                                 "python": "/usr/bin/python3"})  # fmt: skip
    assert other.status_code == 403
    assert other.json()["detail"][0]["loc"] == ["body", "python"]
    assert "TORCHYARD_ALLOWED_PYTHONS" in message(other)
    relative = api.post(JOBS, json={"name": "p", "entrypoint": "worker.tasks.seed:ddp_step",
                                    "python": "bin/python"})  # fmt: skip
    assert relative.status_code == 422


def test_an_interpreter_without_torch_is_refused_naming_what_it_lacks(
    settings: Settings, tmp_path: Path
) -> None:
    from service.accounts import Account
    from service.domain import policy
    from service.errors import InvalidRequest

    bare = tmp_path / "envs" / "bare" / "bin" / "python"
    bare.parent.mkdir(parents=True)
    bare.write_text(f'#!/bin/sh\nexec {sys.base_prefix}/bin/python3 -S "$@"\n')
    bare.chmod(bare.stat().st_mode | stat.S_IXUSR)
    allowed = settings.model_copy(update={"allowed_pythons": [str(tmp_path / "envs")]})

    assert policy.check_python_allowed(str(bare), allowed) == str(bare)
    with pytest.raises(InvalidRequest) as refused:
        policy.check_python_runs_jobs(str(bare), Account.current().name)
    assert refused.value.field == "python"
    assert "lacks torch, submitit" in refused.value.message


# ---------------------------------------------------------------- the job's copy and collection


def test_the_dispatcher_unpacks_the_snapshot_read_only(api: TestClient, coder: dict[str, str]) -> None:
    from tests.support import wait_for

    code_id = api.post(CODE, content=project(), headers={**coder, **GZIP}).json()["id"]
    job = api.post(JOBS, json={"name": "c", "code": code_id, "entrypoint": "train:main"}, headers=coder)
    folder = Path(wait_for(lambda: api.get(f"{JOBS}/{job.json()['id']}", headers=coder).json()["folder"]))
    code = wait_for(lambda: (folder / "code") if (folder / "code").is_dir() else None)

    assert (code / "model" / "net.py").read_text() == "X = 1\n"
    assert os.readlink(code / "latest") == "model/net.py"
    assert stat.S_IMODE((code / "train.py").stat().st_mode) == 0o444


def test_the_housekeeping_pass_keeps_what_unfinished_jobs_use_and_removes_old_unused_snapshots(
    api: TestClient, coder: dict[str, str]
) -> None:
    runtime = runtime_of(api)
    used = api.post(CODE, content=project(), headers={**coder, **GZIP}).json()["id"]
    unused = api.post(CODE, content=pack_text("unused"), headers={**coder, **GZIP}).json()["id"]
    fresh = api.post(CODE, content=pack_text("fresh"), headers={**coder, **GZIP}).json()["id"]
    api.post(JOBS, json={"name": "c", "code": used, "entrypoint": "train:main"}, headers=coder)
    with session_scope(runtime.engine) as session:
        for code_id in (used, unused):  # both last uploaded before what the setting keeps
            row = session.get(CodeSnapshot, (code_id[7:], "carol"))
            assert row is not None
            row.uploaded_at = row.uploaded_at.replace(year=2000)
            session.add(row)

    runtime.housekeeper.run_pass()  # the service's own pass, hourly (torchyard code gc does the same)

    store = code_store.store_root(runtime.settings)
    assert not (store / f"{unused[7:]}.tar.gz").exists()
    assert (store / f"{used[7:]}.tar.gz").exists() and (store / f"{fresh[7:]}.tar.gz").exists()
    with Session(runtime.engine) as session:
        assert session.get(CodeSnapshot, (unused[7:], "carol")) is None
    assert api.get(f"{CODE}/{unused}", headers=coder).status_code == 404


def test_uploading_an_old_snapshot_again_keeps_it_from_collection(
    api: TestClient, coder: dict[str, str]
) -> None:
    """The answer 200 says the service has the files: they must still be there when the job that
    names them is submitted, however long ago the first upload was."""
    runtime = runtime_of(api)
    first = api.post(CODE, content=project(), headers={**coder, **GZIP}).json()
    with session_scope(runtime.engine) as session:
        row = session.get(CodeSnapshot, (first["id"][7:], "carol"))
        assert row is not None
        row.created_at = row.uploaded_at = row.created_at.replace(year=2000)
        session.add(row)

    again = api.post(CODE, content=project(), headers={**coder, **GZIP})
    runtime.housekeeper.run_pass()

    assert again.status_code == 200
    assert again.json()["created_at"].startswith("2000-")
    assert not again.json()["uploaded_at"].startswith("2000-")
    assert api.get(f"{CODE}/{first['id']}", headers=coder).status_code == 200
    job = api.post(JOBS, json={"name": "c", "code": first["id"], "entrypoint": "train:main"}, headers=coder)
    assert job.status_code == 201, job.text


def test_simultaneous_uploads_of_the_same_files_all_succeed(settings: Settings) -> None:
    data = pack_text("twice at once")
    eight_at_once = settings.model_copy(update={"max_uploads_in_flight_per_user": 8})  # the default: 2
    with TestClient(create_app(eight_at_once, backends={"local": FakeBackend("local")})) as api:
        coder = bearer(issue_token(runtime_of(api).engine, "carol", allow_code=True))
        with ThreadPoolExecutor(8) as pool:
            answers = list(
                pool.map(lambda _: api.post(CODE, content=data, headers={**coder, **GZIP}), range(8))
            )

        assert sorted(answer.status_code for answer in answers) == [200] * 7 + [201], [
            a.text for a in answers
        ]
        with Session(runtime_of(api).engine) as session:
            assert len(session.exec(select(CodeSnapshot)).all()) == 1


def test_a_snapshot_whose_files_are_gone_is_404_until_uploaded_again(
    api: TestClient, coder: dict[str, str]
) -> None:
    """Collection removes files after its commit; an upload of the same files in between keeps its row
    but finds its files gone. That must read as "not stored" (the client uploads on a 404), not 500."""
    code_id = api.post(CODE, content=project(), headers={**coder, **GZIP}).json()["id"]
    store = code_store.store_root(runtime_of(api).settings)
    code_store.remove_files(runtime_of(api).settings, [code_id[7:]])
    job = {"name": "c", "code": code_id, "entrypoint": "train:main"}

    gone = api.get(f"{CODE}/{code_id}", headers=coder)
    refused = api.post(JOBS, json=job, headers=coder)
    again = api.post(CODE, content=project(), headers={**coder, **GZIP})

    assert gone.status_code == 404 and "no longer stored" in gone.text
    assert refused.status_code == 404 and "no longer stored" in refused.text
    assert again.status_code == 200 and (store / f"{code_id[7:]}.tar.gz").is_file()
    assert api.get(f"{CODE}/{code_id}", headers=coder).status_code == 200
    assert api.post(JOBS, json=job, headers=coder).status_code == 201


def pack_text(text: str) -> bytes:
    return tar_gz((member("train.py"), f"# {text}\n".encode()))


def test_packing_is_deterministic_and_honours_ignore_files(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    for name in ("train.py", "model/net.py", "data/big.csv", "notes.log", ".git/HEAD", ".venv/x",
                 "model/__pycache__/net.pyc", "keep.log", "build/out.o"):  # fmt: skip
        (proj / name).parent.mkdir(parents=True, exist_ok=True)
        (proj / name).write_text(name)
    (proj / ".gitignore").write_text("# comment\n*.log\n!keep.log\n/build/\n")
    (proj / ".torchyardignore").write_text("data/\n")

    first = pack(proj)
    os.utime(proj / "train.py", (1, 1))  # a new time changes nothing
    second = pack(proj)

    assert first.data == second.data and first.id == second.id
    with tarfile.open(fileobj=io.BytesIO(first.data)) as tar:
        names = sorted(tar.getnames())
    assert names == [".gitignore", ".torchyardignore", "keep.log", "model", "model/net.py", "train.py"]
    assert first.files == 5
