"""Packing a project folder as a code snapshot (the client's side of POST /api/v1/code).

The archive is deterministic: members sorted, times, owners and gzip header zeroed, modes reduced to
0644/0755. The same files therefore give the same bytes and so the same id (`sha256:<hex>` of the
archive), which the client computes before uploading and asks the service about: unchanged code is
never sent twice.

Left out: `.git`, `.venv`, `__pycache__` (and `*.pyc`), and what the folder's `.gitignore` and
`.torchyardignore` name. Their patterns follow git's for the common cases: `#` comments, `!` to take
a pattern back, a trailing `/` for folders only, a `/` at the start or in the middle anchors the
pattern to the project's top, `*`, `?`, `[...]` and `**`. Ignore files in subfolders are not read.
Symlinks are packed as links (the service refuses one that leads out of the project).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path

from worker.spec import CODE_ID_PREFIX

ALWAYS_SKIPPED = (".git", ".venv", "__pycache__", "*.pyc")
IGNORE_FILES = (".gitignore", ".torchyardignore")


@dataclass(frozen=True)
class Packed:
    """A packed project: its archive, its id, and how many files it holds."""

    data: bytes
    files: int

    @property
    def id(self) -> str:
        return CODE_ID_PREFIX + hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class _Rule:
    pattern: re.Pattern[str]
    negated: bool
    folders_only: bool


def pack(folder: Path) -> Packed:
    """`folder` as a deterministic .tar.gz, without what is skipped or ignored."""
    root = folder.resolve()
    if not root.is_dir():
        raise NotADirectoryError(f"{folder} is not a folder")
    rules = _rules(root)
    raw = io.BytesIO()
    files = 0
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path, relative in _walk(root, rules):
            info = tar.gettarinfo(str(path), arcname=relative)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if info.isreg():
                info.mode = 0o755 if info.mode & 0o100 else 0o644
                with path.open("rb") as content:
                    tar.addfile(info, content)
                files += 1
            elif info.issym():
                info.mode = 0o777
                tar.addfile(info)
                files += 1
            elif info.isdir():
                info.mode = 0o755
                tar.addfile(info)
    compressed = io.BytesIO()
    with gzip.GzipFile(fileobj=compressed, mode="wb", mtime=0, filename="") as out:
        out.write(raw.getvalue())
    return Packed(compressed.getvalue(), files)


def _walk(root: Path, rules: list[_Rule]) -> list[tuple[Path, str]]:
    """(path, relative name) of everything packed, sorted; ignored folders are not entered."""
    found: list[tuple[Path, str]] = []
    for current, folders, names in os.walk(root):
        base = Path(current)
        relative_base = base.relative_to(root).as_posix()
        prefix = "" if relative_base == "." else relative_base + "/"
        kept = []
        for name in sorted(folders):
            path = base / name
            if path.is_symlink():  # a link to a folder is packed as a link, not followed
                names.append(name)
            elif not _ignored(prefix + name, True, rules):
                kept.append(name)
                found.append((path, prefix + name))
        folders[:] = kept
        for name in sorted(names):
            if not _ignored(prefix + name, False, rules):
                found.append((base / name, prefix + name))
    return sorted(found, key=lambda item: item[1])


def _ignored(relative: str, is_folder: bool, rules: list[_Rule]) -> bool:
    ignored = False
    for rule in rules:
        if rule.folders_only and not is_folder:
            continue
        if rule.pattern.fullmatch(relative):
            ignored = not rule.negated
    return ignored


def _rules(root: Path) -> list[_Rule]:
    lines = list(ALWAYS_SKIPPED)
    for name in IGNORE_FILES:
        path = root / name
        if path.is_file():
            lines += path.read_text(errors="replace").splitlines()
    rules = []
    for line in lines:
        rule = _rule(line.rstrip())
        if rule is not None:
            rules.append(rule)
    return rules


def _rule(line: str) -> _Rule | None:
    if not line or line.startswith("#"):
        return None
    negated = line.startswith("!")
    line = line[1:] if negated else line
    folders_only = line.endswith("/")
    line = line.rstrip("/")
    anchored = "/" in line
    line = line.lstrip("/")
    if not line:
        return None
    body = _translate(line)
    pattern = body if anchored else f"(?:.*/)?{body}"
    return _Rule(re.compile(pattern), negated, folders_only)


def _translate(glob: str) -> str:
    """A gitignore glob as a regular expression over '/'-separated relative paths."""
    out, index = [], 0
    while index < len(glob):
        char = glob[index]
        if glob.startswith("**/", index):
            out.append("(?:.*/)?")
            index += 3
            continue
        if glob.startswith("/**", index) and index + 3 == len(glob):
            out.append("/.*")
            index += 3
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = glob.find("]", index + 1)
            if end < 0:
                out.append(re.escape(char))
            else:
                out.append("[" + glob[index + 1 : end].replace("!", "^", 1) + "]")
                index = end
        else:
            out.append(re.escape(char))
        index += 1
    return "".join(out)
