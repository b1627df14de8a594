"""Code snapshots: a user's project, uploaded as a .tar.gz or zip, stored once by its SHA-256.

The archive is untrusted: the upload streams it to a file of the store's staging folder (`code-staging`)
(service.domain.code_uploads), and service.domain.code_archive checks it whole before it is stored,
in `<data dir>/code/` (the service's alone): `<hex>.tar.gz` (a zip is stored re-packed as one, so the
ranks' side has one format) and `<hex>.json`, its file list. The id is the SHA-256 of the bytes
uploaded, so a client can tell before uploading whether the service has them (`torchyard submit
--code` packs deterministically to make that pay).

A snapshot belongs to every user who uploaded it (one `CodeSnapshot` row each); another user's id is
a 404. Its jobs share one read-only unpacked copy (service.domain.code_copies), made off the dispatch
thread (service.loops.code_prep); the ranks never read the store. What the copy takes counts against
each owner with the archive: `unpacked_bytes`, summed at upload as the archive is checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import bindparam, func
from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, select

from service.config import Settings
from service.domain.auth import Principal
from service.domain.code_archive import FIELD, check_archive, is_zip, unpacked_size, zip_as_tar_gz
from service.domain.code_copies import remove_copies
from service.errors import Forbidden, NotFound
from service.ledger.models.code_snapshots import CodeSnapshot, CodeSnapshotDetail, CodeSnapshotPublic
from service.ledger.models.columns import utcnow
from service.ledger.models.jobs import Job
from service.states import JobState, is_terminal
from worker.spec import CODE_ID_PREFIX

SHOWN_PATHS = 10_000
_BYTES_HELD = select(
    func.coalesce(func.sum(col(CodeSnapshot.bytes) + col(CodeSnapshot.unpacked_bytes)), 0)
).where(col(CodeSnapshot.owner) == bindparam("owner"))
STORE_MODE = 0o700  # the service's alone: jobs read their shared copy (service.domain.code_copies)
STALE_STAGING_S = 3600.0
STAGING = "code-staging"  # beside the store, the service's alone too: uploads in flight, a file each


@dataclass(frozen=True)
class Staged:
    """An upload's body, streamed to a file of the store's staging folder: its SHA-256 and size."""

    path: Path
    digest: str
    size: int


# ---------------------------------------------------------------- the store


def digest_of(code_id: str) -> str:
    return code_id.removeprefix(CODE_ID_PREFIX)


class CodeStore:
    """The folder of stored snapshots, and the ledger rows that say whose they are."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.root = store_root(settings)

    def staging(self) -> Path:
        """The folder uploads stream into (the service's alone, like the store), beside it: what is
        in the store is only ever a whole, checked snapshot."""
        folder = staging_root(self._settings)
        folder.mkdir(mode=STORE_MODE, parents=True, exist_ok=True)
        return folder

    def add(
        self, session: Session, user: Principal, staged: Staged, most_held: int | None = None
    ) -> tuple[CodeSnapshotPublic, bool]:
        """Store the `staged` archive for `user` (once, whoever uploaded it before); True when it is
        new to them. With `most_held`, the bytes of snapshots they may have stored (archives and
        unpacked files): the archive's bytes are checked before the archive is (the cheaper check),
        its unpacked bytes once they are known, both before anything is stored."""
        require_code_permission(user)
        digest = staged.digest
        if most_held is not None:
            self.check_room_for(session, user.user, digest, staged.size, most_held)
        with staged.path.open("rb") as data:
            members = check_archive(data, self._settings.max_code_bytes)
            unpacked = unpacked_size(members)
            if most_held is not None:
                self.check_room_for(session, user.user, digest, staged.size + unpacked, most_held)
            files = [member for member in members if member.kind != "dir"]
            self._write(digest, data, sorted(member.path for member in files))
        now = utcnow()
        # One statement whether the row is new or not: two uploads of the same files by one user at
        # once both find no row, and the second INSERT would fail. A repeat upload moves uploaded_at,
        # which collection goes by.
        upsert = _insert_for(session)(CodeSnapshot).values(
            digest=digest, owner=user.user, bytes=staged.size, unpacked_bytes=unpacked, files=len(files),
            created_at=now, uploaded_at=now,
        )  # fmt: skip
        upsert = upsert.on_conflict_do_update(
            index_elements=["digest", "owner"], set_={"uploaded_at": upsert.excluded.uploaded_at}
        )
        session.execute(upsert)
        row = session.get(CodeSnapshot, (digest, user.user), populate_existing=True)
        assert row is not None  # just written, in this transaction
        return public(row), row.created_at == now

    def check_room_for(self, session: Session, owner: str, digest: str, size: int, most: int) -> None:
        """Forbidden (field `archive`) when `size` more bytes (the archive's, then with its unpacked
        files') would take `owner`'s snapshots past `most`. A snapshot they have already adds nothing:
        uploading it again must work at the limit."""
        if session.get(CodeSnapshot, (digest, owner)) is not None:
            return
        held = int(session.execute(_BYTES_HELD, {"owner": owner}).scalar_one())
        if held + size > most:
            raise Forbidden(
                f"your code snapshots hold {held} bytes (archives and their unpacked files), and this "
                f"archive's {size} more would pass your "
                f"limit of {most} bytes (TORCHYARD_MAX_CODE_BYTES_PER_USER): a snapshot no unfinished job "
                f"uses is removed {self._settings.code_keep_h:g} hours after its last upload",
                field=FIELD,
            )

    def describe(self, session: Session, user: Principal, code_id: str) -> CodeSnapshotDetail:
        row = find(session, user, code_id)
        paths = self.paths(row.digest)
        return CodeSnapshotDetail(**public(row).model_dump(), paths=paths[:SHOWN_PATHS])

    def paths(self, digest: str) -> list[str]:
        """The snapshot's files, as stored at upload. NotFound when its files are gone although a
        row names it (collection removed them while the same files were uploaded again): the
        client's answer to a 404 is to upload them, which stores them again."""
        try:
            loaded: list[str] = json.loads((self.root / f"{digest}.json").read_text())
        except FileNotFoundError:
            raise NotFound(
                f"the files of code snapshot {CODE_ID_PREFIX}{digest} are no longer stored "
                "(upload them again: POST /api/v1/code)",
                field="code",
            ) from None
        return loaded

    def archive(self, digest: str) -> Path:
        return self.root / f"{digest}.tar.gz"

    def _write(self, digest: str, data: BinaryIO, paths: list[str]) -> None:
        """The archive (a zip re-packed as .tar.gz) and its file list; written once, atomically."""
        self.root.mkdir(mode=STORE_MODE, parents=True, exist_ok=True)
        if self.archive(digest).is_file() and (self.root / f"{digest}.json").is_file():
            return
        self._write_file(f"{digest}.json", lambda out: out.write(json.dumps(paths).encode()))
        if is_zip(data):
            self._write_file(f"{digest}.tar.gz", lambda out: zip_as_tar_gz(data, out))
        else:
            self._write_file(f"{digest}.tar.gz", lambda out: shutil.copyfileobj(data, out))

    def _write_file(self, name: str, write: Callable[[BinaryIO], object]) -> None:
        partial = self.root / f".{uuid.uuid4().hex}.partial"
        try:
            with partial.open("wb") as out:
                write(out)
            os.replace(partial, self.root / name)
        finally:
            partial.unlink(missing_ok=True)


def store_root(settings: Settings) -> Path:
    return settings.data_dir.resolve() / "code"


def staging_root(settings: Settings) -> Path:
    return settings.data_dir.resolve() / STAGING


def public(row: CodeSnapshot) -> CodeSnapshotPublic:
    return CodeSnapshotPublic(id=CODE_ID_PREFIX + row.digest, bytes=row.bytes, files=row.files,
                              unpacked_bytes=row.unpacked_bytes, created_at=row.created_at,
                              uploaded_at=row.uploaded_at)  # fmt: skip


def _insert_for(session: Session) -> Callable[..., Any]:
    """The dialect's INSERT, which has ON CONFLICT (SQLite and PostgreSQL spell it alike)."""
    return postgresql.insert if session.get_bind().dialect.name == "postgresql" else sqlite.insert


def require_code_permission(user: Principal) -> None:
    if not (user.admin or user.allow_code):
        raise Forbidden(
            "you may not run uploaded code on this service: an operator allows it "
            "(`torchyard token create --user NAME --allow-code` or `torchyard quota set --user NAME "
            "--allow-code true`)",
            field="code",
        )


def find(session: Session, user: Principal, code_id: str) -> CodeSnapshot:
    """The snapshot `code_id` as `user` may use it: theirs (any uploader's, for an admin), else 404."""
    digest = digest_of(code_id)
    query = select(CodeSnapshot).where(col(CodeSnapshot.digest) == digest)
    if not user.admin:
        query = query.where(col(CodeSnapshot.owner) == user.user)
    row = session.exec(query).first()
    if row is None:
        raise NotFound(f"no code snapshot {code_id} of yours (upload it: POST /api/v1/code)", field="code")
    return row


# ---------------------------------------------------------------- collection


def collect(session: Session, settings: Settings) -> list[str]:
    """Forget the snapshots no unfinished job uses that are older than TORCHYARD_CODE_KEEP_H, and
    return their digests; the caller commits, then removes their files (`remove_files`).

    A finished job's `code` links to the snapshot's shared copy, which goes with the snapshot: what
    it ran is there only as long as the snapshot is kept."""
    in_use = {
        digest_of(spec["code"])
        for (spec,) in session.execute(
            select(Job.spec).where(col(Job.state).in_([s.value for s in JobState if not is_terminal(s)]))
        )
        if isinstance(spec, dict) and spec.get("code")
    }
    cutoff = utcnow() - timedelta(hours=settings.code_keep_h)
    rows = session.exec(select(CodeSnapshot)).all()
    newest: dict[str, CodeSnapshot] = {}
    for row in rows:  # a snapshot is as young as its latest upload by anyone
        if row.digest not in newest or row.uploaded_at > newest[row.digest].uploaded_at:
            newest[row.digest] = row
    removed = [digest for digest, row in newest.items() if digest not in in_use and row.uploaded_at < cutoff]
    for row in rows:
        if row.digest in removed:
            session.delete(row)
    return removed


def remove_files(settings: Settings, digests: list[str]) -> None:
    """The snapshots' archives, file lists and unpacked copies; and what uploads cut short by a
    stopped service left in staging (an upload in flight is never that old: its connection's own
    timeouts end it first)."""
    root = store_root(settings)
    for digest in digests:
        for name in (f"{digest}.tar.gz", f"{digest}.json"):
            (root / name).unlink(missing_ok=True)
    remove_copies(settings, digests)
    left_before = time.time() - STALE_STAGING_S
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(staging_root(settings)):
            if entry.stat(follow_symlinks=False).st_mtime < left_before:
                Path(entry.path).unlink(missing_ok=True)
