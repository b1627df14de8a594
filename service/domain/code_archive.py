"""Checking a code snapshot's archive: a user's project as a .tar.gz, .tar or zip, untrusted.

It is checked whole, from the upload's staging file, before it is stored: a path that is absolute or
climbs out with `..`, a link that leads out of the project or through another link, a hard link, a device or
FIFO, more unpacked bytes than 4 x TORCHYARD_MAX_CODE_BYTES or more than MAX_FILES members are
refused with a 422 naming the problem (field `archive`). The same rules guard the unpacking of a
stored snapshot into a job's folder (`unpack_filter`). The store itself is service.domain.code_store.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import tarfile
import time
import zipfile
import zlib
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from service.errors import InvalidRequest, TooLarge
from service.jobfs import new_file

MAX_FILES = 100_000
UNPACKED_FACTOR = 4  # unpacked files may hold this many times TORCHYARD_MAX_CODE_BYTES
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


def is_zip(data: bytes | BinaryIO) -> bool:
    """A zip (a local file header, or the end record of an empty one); anything else is read as tar."""
    return _head(data) in (b"PK\x03\x04", b"PK\x05\x06")


def _head(data: bytes | BinaryIO, size: int = 4) -> bytes:
    if isinstance(data, bytes):
        return data[:size]
    data.seek(0)
    head = data.read(size)
    data.seek(0)
    return head


def _as_file(data: bytes | BinaryIO) -> BinaryIO:
    return io.BytesIO(data) if isinstance(data, bytes) else data


def unpacked_size(members: list[Member]) -> int:
    """The bytes a checked archive's files take once unpacked: what a snapshot's copy costs its owner."""
    return sum(member.size for member in members)


def check_archive(data: bytes | BinaryIO, max_bytes: int) -> list[Member]:
    """Every member of a .tar.gz / .tar / zip (its bytes, or a seekable file of them), checked;
    InvalidRequest (field `archive`) for the first problem. Nothing is written."""
    source = _as_file(data)
    size = source.seek(0, os.SEEK_END)
    source.seek(0)
    if size > max_bytes:
        raise TooLarge(f"the archive is {size} bytes, over TORCHYARD_MAX_CODE_BYTES ({max_bytes})")
    budget = _Budget(UNPACKED_FACTOR * max_bytes)
    members = _zip_members(source, budget) if is_zip(source) else _tar_members(source, budget)
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


def _tar_members(data: BinaryIO, budget: _Budget) -> list[Member]:
    try:
        archive = tarfile.open(fileobj=data, mode="r:*")  # noqa: SIM115 - closed below
    except (tarfile.TarError, EOFError, OSError, zlib.error):
        if _head(data, len(GZIP_MAGIC)) == GZIP_MAGIC:
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


def _zip_members(data: BinaryIO, budget: _Budget) -> list[Member]:
    try:
        archive = zipfile.ZipFile(data)
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


def zip_as_tar_gz(data: bytes | BinaryIO, out: BinaryIO) -> None:
    """A checked zip's members as a .tar.gz written to `out`, so that one unpacker (`unpack`) serves
    both. A member at a time: a zip's files are never all in memory at once."""
    with zipfile.ZipFile(_as_file(data)) as archive, tarfile.open(fileobj=out, mode="w:gz") as tar:
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
                member.size, member.mode = info.file_size, (mode & 0o777) or 0o644
                with archive.open(info) as content:
                    tar.addfile(member, content)


# ---------------------------------------------------------------- unpacking


class TooSlow(tarfile.TarError):
    """An unpack past its deadline (TORCHYARD_CODE_UNPACK_TIMEOUT_S)."""


def unpack(tar: tarfile.TarFile, building: Path, deadline: float = float("inf")) -> None:
    """Every member of a stored snapshot into `building` (a folder only the service can enter), each
    held to check_archive's rules against the members unpacked before it: a snapshot stored before a
    rule was made is held to it too, at the cost of no second read of the archive. Its refusal is a
    TarError, which fails the one job (not the dispatcher's batch).

    Written member by member rather than by tarfile's extractall: its `filter` argument, the only
    guard it has against an archive's own owners, modes and links, is missing from Python 3.11.2
    (Debian 12's), and the rules above are stricter than any of its filters anyway. A file is created
    anew (never through a link), read-only to the job; a folder is readable by it. Past `deadline`
    (time.monotonic()) it stops with TooSlow, between members and between a file's chunks."""
    links: set[str] = set()
    for info in tar:
        _check_deadline(deadline)
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
        with source, new_file(target, 0o600) as out:
            while chunk := source.read(CHUNK):
                out.write(chunk)
                _check_deadline(deadline)
            os.fchmod(out.fileno(), 0o555 if member.mode & 0o100 else 0o444)


CHUNK = 1 << 20


def _check_deadline(deadline: float) -> None:
    if time.monotonic() > deadline:
        raise TooSlow("the code snapshot took longer to unpack than TORCHYARD_CODE_UNPACK_TIMEOUT_S")
