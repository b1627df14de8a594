"""Code snapshots: a user's project, uploaded as a .tar.gz or zip, stored once by its SHA-256.

The archive is untrusted. It is checked whole, in memory, before anything is written: a path that is
absolute or climbs out with `..`, a link that leads out of the project, a hard link, a device or FIFO,
more unpacked bytes than 4 x TORCHYARD_MAX_CODE_BYTES or more than MAX_FILES members are refused with
a 422 naming the problem. Only then is it stored, in `<data dir>/code/` (the service's alone):
`<hex>.tar.gz` (a zip is stored re-packed as one, so the ranks' side has one format) and `<hex>.json`,
its file list. The id is the SHA-256 of the bytes uploaded, so a client can tell before uploading
whether the service has them (`torchyard submit --code` packs deterministically to make that pay).

A snapshot belongs to every user who uploaded it (one `CodeSnapshot` row each); another user's id is
a 404. The dispatcher unpacks it read-only into each job's folder (`unpack_into`), checking every
member again as it goes; the ranks never read the store.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
import shutil
import stat
import tarfile
import uuid
import zipfile
import zlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlmodel import Session, col, select

from service.config import Settings
from service.domain.auth import Principal
from service.errors import Forbidden, InvalidRequest, NotFound, TooLarge
from service.ledger.models import CodeSnapshot, CodeSnapshotDetail, CodeSnapshotPublic, Job, utcnow
from service.states import JobState, is_terminal
from worker.spec import CODE_ID_PREFIX

MAX_FILES = 100_000
UNPACKED_FACTOR = 4  # unpacked files may hold this many times TORCHYARD_MAX_CODE_BYTES
SHOWN_PATHS = 10_000
STORE_MODE = 0o700  # the service's alone: jobs get their copy unpacked in their folder
FIELD = "archive"
GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Member:
    """One checked entry of an archive: a file, folder or link inside the project."""

    path: str  # normalized, relative, '/'-separated
    kind: str  # "file", "dir" or "link"
    size: int = 0
    mode: int = 0o644
    target: str = ""  # a link's target, relative


# ---------------------------------------------------------------- checking an archive


def is_zip(data: bytes) -> bool:
    """A zip (a local file header, or the end record of an empty one); anything else is read as tar."""
    return data[:4] in (b"PK\x03\x04", b"PK\x05\x06")


def check_archive(data: bytes, max_bytes: int) -> list[Member]:
    """Every member of a .tar.gz / .tar / zip, checked; InvalidRequest (field `archive`) for the first
    problem. Nothing is written."""
    if len(data) > max_bytes:
        raise TooLarge(f"the archive is {len(data)} bytes, over TORCHYARD_MAX_CODE_BYTES ({max_bytes})")
    budget = _Budget(UNPACKED_FACTOR * max_bytes)
    members = _zip_members(data, budget) if is_zip(data) else _tar_members(data, budget)
    kinds: dict[str, str] = {}
    for member in members:  # a folder may be listed again; nothing else, nor in a folder's place
        earlier = kinds.get(member.path)
        if earlier is not None and (earlier != "dir" or member.kind != "dir"):
            raise InvalidRequest(f"'{member.path}' is in the archive twice", field=FIELD)
        kinds[member.path] = member.kind
    if not any(member.kind != "dir" for member in members):
        raise InvalidRequest("the archive holds no files", field=FIELD)
    links = {member.path for member in members if member.kind == "link"}
    for member in members:
        _check_not_through_links(member, links)
    return members


def _check_not_through_links(member: Member, links: Collection[str]) -> None:
    """Where a member lands, and where a link leads, is judged by their text: that holds only while no
    path goes *through* a link of the archive (`l/x` with `l` a link, or `l/..`). Through one, the text
    says nothing of the place (two links `a/l -> ..`, `a/l/m -> ..` climb out), and tarfile's own
    guard has failed on such chains (CVE-2025-4517), so they are refused: a link may only be the last
    step of a path."""
    parts = member.path.split("/")
    for end in range(1, len(parts)):
        if (through := "/".join(parts[:end])) in links:
            raise InvalidRequest(f"'{member.path}' lies inside the link '{through}'", field=FIELD)
    if member.kind != "link":
        return
    place = parts[:-1]
    for step in member.target.split("/"):
        if "/".join(place) in links:
            raise InvalidRequest(
                f"link '{member.path}' leads through the link '{'/'.join(place)}'", field=FIELD
            )
        if step == "..":
            place = place[:-1]  # never above the project: _inside_target has refused that
        elif step not in ("", "."):
            place.append(step)


class _Budget:
    """The unpacked bytes and entries an archive may hold, counted as its headers are read: a bomb is
    refused at the first member over the limit, before its content is decompressed to reach the next."""

    def __init__(self, most_bytes: int) -> None:
        self.most_bytes = most_bytes
        self.bytes = 0
        self.entries = 0

    def take(self, member: Member) -> Member:
        self.bytes += member.size
        self.entries += 1
        if self.bytes > self.most_bytes:
            raise InvalidRequest(
                f"its files unpack to more than {self.most_bytes} bytes "
                f"({UNPACKED_FACTOR} x TORCHYARD_MAX_CODE_BYTES)",
                field=FIELD,
            )
        if self.entries > MAX_FILES:
            raise InvalidRequest(f"holds more than {MAX_FILES} entries", field=FIELD)
        return member


def _tar_members(data: bytes, budget: _Budget) -> list[Member]:
    try:
        archive = tarfile.open(fileobj=io.BytesIO(data), mode="r:*")  # noqa: SIM115 - closed below
    except (tarfile.TarError, EOFError, OSError, zlib.error):
        if data.startswith(GZIP_MAGIC):
            raise InvalidRequest("the archive is damaged or cut short", field=FIELD) from None
        raise InvalidRequest("is not a .tar.gz, .tar or zip archive", field=FIELD) from None
    members: list[Member] = []
    try:
        with archive:
            for info in archive:  # one header at a time
                members.append(budget.take(_tar_member(info)))
    except (tarfile.TarError, EOFError, OSError, zlib.error):  # zlib's: a damaged gzip stream
        raise InvalidRequest("the archive is damaged or cut short", field=FIELD) from None
    return members


def _tar_member(info: tarfile.TarInfo) -> Member:
    path = _inside_path(info.name)
    if info.isdir():
        return Member(path, "dir")
    if info.issym():
        return Member(path, "link", target=_inside_target(path, info.linkname))
    if info.islnk():
        raise InvalidRequest(f"'{path}' is a hard link: pack the file itself", field=FIELD)
    if not info.isreg():
        raise InvalidRequest(f"'{path}' is a device, FIFO or other special file", field=FIELD)
    return Member(path, "file", size=info.size, mode=info.mode & 0o777)


def _zip_members(data: bytes, budget: _Budget) -> list[Member]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        raise InvalidRequest("is not a .tar.gz, .tar or zip archive", field=FIELD) from None
    members = []
    for info in infos:
        path = _inside_path(info.filename)
        mode = info.external_attr >> 16
        if info.is_dir():
            members.append(budget.take(Member(path, "dir")))
        elif stat.S_ISLNK(mode):
            members.append(
                budget.take(Member(path, "link", target=_inside_target(path, _zip_link(archive, info))))
            )
        elif stat.S_IFMT(mode) and not stat.S_ISREG(mode):  # no type bits: a plain file
            raise InvalidRequest(f"'{path}' is a device, FIFO or other special file", field=FIELD)
        else:
            members.append(
                budget.take(Member(path, "file", size=info.file_size, mode=(mode & 0o777) or 0o644))
            )
    try:  # every member's content against its CRC, now that their sizes are known to be bounded
        damaged = archive.testzip()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, zlib.error):
        damaged = "?"
    if damaged is not None:
        raise InvalidRequest("the archive is damaged or cut short", field=FIELD)
    return members


def _zip_link(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> str:
    """A zip symlink's target: its content, of which no more than a path's worth is read."""
    try:
        with archive.open(info) as content:
            return content.read(4096).decode("utf-8", "replace")
    except (zipfile.BadZipFile, OSError, ValueError, zlib.error):
        raise InvalidRequest(f"link '{info.filename}' cannot be read", field=FIELD) from None


def _inside_path(name: str) -> str:
    """The member's path relative to the project: no absolute path, no `..`, no NUL or backslash tricks."""
    if "\x00" in name or "\\" in name:
        raise InvalidRequest(f"{name!r} is not a plain relative path", field=FIELD)
    if name.startswith("/"):
        raise InvalidRequest(f"'{name}' is an absolute path", field=FIELD)
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise InvalidRequest(f"'{name}' leads out of the project ('..')", field=FIELD)
    if not parts:
        return "."
    return "/".join(parts)


def _inside_target(path: str, target: str) -> str:
    """A link's target, which must stay inside the project once joined to the link's folder."""
    if target.startswith("/") or "\x00" in target:
        raise InvalidRequest(f"link '{path}' points to an absolute path ('{target}')", field=FIELD)
    joined = posixpath.normpath(posixpath.join(posixpath.dirname(path), target))
    if joined == ".." or joined.startswith("../"):
        raise InvalidRequest(f"link '{path}' leads out of the project ('{target}')", field=FIELD)
    return target


# ---------------------------------------------------------------- the store


def digest_of(code_id: str) -> str:
    return code_id.removeprefix(CODE_ID_PREFIX)


class CodeStore:
    """The folder of stored snapshots, and the ledger rows that say whose they are."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self.root = store_root(settings)

    def add(self, session: Session, user: Principal, data: bytes) -> tuple[CodeSnapshotPublic, bool]:
        """Store `data` for `user` (once, whoever uploaded it before); True when it is new to them."""
        require_code_permission(user)
        members = check_archive(data, self._settings.max_code_bytes)
        digest = hashlib.sha256(data).hexdigest()
        files = [member for member in members if member.kind != "dir"]
        self._write(digest, data, sorted(member.path for member in files))
        now = utcnow()
        # One statement whether the row is new or not: two uploads of the same files by one user at
        # once both find no row, and the second INSERT would fail. A repeat upload moves uploaded_at,
        # which collection goes by.
        upsert = _insert_for(session)(CodeSnapshot).values(
            digest=digest, owner=user.user, bytes=len(data), files=len(files), created_at=now, uploaded_at=now
        )
        upsert = upsert.on_conflict_do_update(
            index_elements=["digest", "owner"], set_={"uploaded_at": upsert.excluded.uploaded_at}
        )
        session.execute(upsert)
        row = session.get(CodeSnapshot, (digest, user.user), populate_existing=True)
        assert row is not None  # just written, in this transaction
        return public(row), row.created_at == now

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

    def _write(self, digest: str, data: bytes, paths: list[str]) -> None:
        """The archive (a zip re-packed as .tar.gz) and its file list; written once, atomically."""
        self.root.mkdir(mode=STORE_MODE, parents=True, exist_ok=True)
        if self.archive(digest).is_file() and (self.root / f"{digest}.json").is_file():
            return
        stored = _zip_as_tar_gz(data) if is_zip(data) else data
        for name, content in ((f"{digest}.json", json.dumps(paths).encode()), (f"{digest}.tar.gz", stored)):
            partial = self.root / f".{uuid.uuid4().hex}.partial"
            partial.write_bytes(content)
            os.replace(partial, self.root / name)


def store_root(settings: Settings) -> Path:
    return settings.data_dir.resolve() / "code"


def public(row: CodeSnapshot) -> CodeSnapshotPublic:
    return CodeSnapshotPublic(id=CODE_ID_PREFIX + row.digest, bytes=row.bytes, files=row.files,
                              created_at=row.created_at, uploaded_at=row.uploaded_at)  # fmt: skip


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


def _zip_as_tar_gz(data: bytes) -> bytes:
    """A checked zip's members as a .tar.gz, so that one unpacker (`_unpack`) serves both."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as archive, tarfile.open(fileobj=out, mode="w:gz") as tar:
        for info in archive.infolist():
            member = tarfile.TarInfo(_inside_path(info.filename))
            mode = info.external_attr >> 16
            if info.is_dir():
                member.type, member.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(member)
            elif stat.S_ISLNK(mode):
                member.type, member.linkname = tarfile.SYMTYPE, _zip_link(archive, info)
                tar.addfile(member)
            else:
                content = archive.read(info)
                member.size, member.mode = len(content), (mode & 0o777) or 0o644
                tar.addfile(member, io.BytesIO(content))
    return out.getvalue()


# ---------------------------------------------------------------- a job's copy


def _unpack(tar: tarfile.TarFile, building: Path) -> None:
    """Every member of a stored snapshot into `building` (a folder only the service can enter), each
    held to check_archive's rules against the members unpacked before it: a snapshot stored before a
    rule was made is held to it too, at the cost of no second read of the archive. Its refusal is a
    TarError, which fails the one job (not the dispatcher's batch).

    Written member by member rather than by tarfile's extractall: its `filter` argument, the only
    guard it has against an archive's own owners, modes and links, is missing from Python 3.11.2
    (Debian 12's), and the rules above are stricter than any of its filters anyway. A file is created
    anew (never through a link), read-only to the job; a folder is readable by it."""
    links: set[str] = set()
    for info in tar:
        try:
            member = _tar_member(info)
            _check_not_through_links(member, links)
        except InvalidRequest as problem:
            raise tarfile.TarError(f"the code snapshot: {problem.message}") from None
        target = building / member.path
        if member.kind == "dir":
            target.mkdir(parents=True, exist_ok=True)
            target.chmod(0o755)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if member.kind == "link":
            links.add(member.path)
            os.symlink(member.target, target)
            continue
        source = tar.extractfile(info)
        if source is None:  # pragma: no cover - a regular member always has content
            raise tarfile.TarError(f"the code snapshot: '{member.path}' has no content")
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with source, os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(source, out)
            os.fchmod(out.fileno(), 0o555 if member.mode & 0o100 else 0o444)


def unpack_into(store_dir: Path, code_id: str, folder: Path) -> Path:
    """The snapshot unpacked as `<folder>/code`, read-only to the job: files 0444 (0555 when
    executable), owned by the service. A retry finds it there already and keeps it.

    The job folder is the job's account's, which could swap any name in it for a link while we
    write: so the tree is built and made read-only in a staging folder only the service can enter,
    and moved in whole by one rename relative to a handle on the job folder opened without
    following links."""
    staging_root = store_dir / ".unpacking"
    staging_root.mkdir(mode=0o700, exist_ok=True)
    building = staging_root / uuid.uuid4().hex
    building.mkdir(mode=0o755)
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        try:
            existing = os.stat("code", dir_fd=handle, follow_symlinks=False)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(existing.st_mode):
                return folder / "code"
            raise NotADirectoryError(f"{folder / 'code'} is not a folder (a link the job made?)")
        with tarfile.open(store_dir / f"{digest_of(code_id)}.tar.gz", mode="r:*") as tar:
            _unpack(tar, building)
        os.rename(building, "code", dst_dir_fd=handle)  # a link planted at `code` is replaced, not followed
    finally:
        os.close(handle)
        shutil.rmtree(building, ignore_errors=True)  # gone already when the rename was made
    return folder / "code"


# ---------------------------------------------------------------- collection


def collect(session: Session, settings: Settings) -> list[str]:
    """Forget the snapshots no unfinished job uses that are older than TORCHYARD_CODE_KEEP_H, and
    return their digests; the caller commits, then removes their files (`remove_files`).

    A job's folder keeps its own unpacked copy, so a finished job still shows what it ran."""
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
    root = store_root(settings)
    for digest in digests:
        for name in (f"{digest}.tar.gz", f"{digest}.json"):
            (root / name).unlink(missing_ok=True)
