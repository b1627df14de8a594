"""Is there room for a new job? Checked at POST time, so a full disk is a clear 507, not a crash later.

Two places must take a new job's writes: the folder its job folder goes in (`<data_dir>/jobs`, made by
the dispatcher) and the ledger (a SQLite file, by default in the data directory too). The first is
checked here before anything is stored; the second can only fail while it is written, and
`ledger_storage_problem` tells such a failure (disk full, read-only) from a database that is down.
"""

from __future__ import annotations

import asyncio
import os
import shutil

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from service.config import Settings
from service.domain.code_store import staging_root
from service.errors import InsufficientStorage
from service.jobfs.names import DATA_DIR_MODE, jobs_root

# What SQLite and PostgreSQL say when they cannot write for want of room or permission.
_NO_ROOM = (
    "database or disk is full",  # SQLITE_FULL
    "attempt to write a readonly database",  # SQLITE_READONLY: a read-only mount, or the file
    "disk i/o error",  # SQLITE_IOERR: what a write on a full or vanished disk often becomes
    "no space left on device",  # PostgreSQL, "could not extend file ...: No space left on device"
)
_PG_DISK_FULL = "53100"  # SQLSTATE disk_full


def prepare_data_dir(settings: Settings) -> None:
    """The data directory and its jobs/ folder, made traversable but not listable: a job's account
    must reach its own folder, and must not see (or write) the ledger or other jobs' folders. And the
    code uploads' staging folder, the service's alone."""
    for folder in (settings.data_dir, jobs_root(settings)):
        folder.mkdir(parents=True, exist_ok=True)
        if folder.stat().st_uid == os.geteuid():  # an operator's folder of its own is left as it is
            folder.chmod(DATA_DIR_MODE)
    staging_root(settings).mkdir(mode=0o700, exist_ok=True)


def check_room(settings: Settings) -> None:
    """InsufficientStorage (507) unless a new job folder can be written: the folder exists (or can be
    made), is writable, and its disk has at least Settings.min_free_disk_mb free (and any room at all:
    a disk with no free block takes no job folder, whatever the setting)."""
    data, jobs = settings.data_dir, jobs_root(settings)
    if jobs.exists() and not jobs.is_dir():
        raise InsufficientStorage(
            f"the data directory {data} cannot take job folders: {jobs} is not a directory"
        )
    folder = jobs if jobs.is_dir() else data  # the dispatcher makes `jobs` in the data directory
    try:
        free = shutil.disk_usage(folder).free
    except OSError as error:
        raise InsufficientStorage(f"the data directory {data} cannot be read: {error.strerror}") from None
    # os.access answers for root too on a read-only mount (EROFS), where permission bits would not.
    if not os.access(folder, os.W_OK | os.X_OK):
        where = "" if folder == data else f" ({folder})"
        raise InsufficientStorage(f"the data directory {data} is not writable by the service{where}")
    free_mb = free // 2**20
    if free == 0 or free_mb < settings.min_free_disk_mb:
        raise InsufficientStorage(
            f"the data directory {data} has {free_mb} MB free, below the "
            f"{max(settings.min_free_disk_mb, 1)} MB this service keeps for job folders and logs"
        )


class RoomCheck:
    """check_room for many concurrent POSTs at once, off the event loop.

    The check is a few file-system calls that could block on a sick mount, so it runs in a thread;
    a thread hop per POST costs more than the check. So requests that ask while a check runs share
    the next one, which starts after all of them asked: every POST is still answered by a check made
    after it arrived (a disk that filled a moment ago is seen), at one hop per round, not per request.
    Used from the one event loop that serves the app.
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._next_round: asyncio.Future[None] | None = None
        self._rounds: asyncio.Task[None] | None = None

    async def check(self) -> None:
        loop = asyncio.get_running_loop()
        if self._next_round is None:
            self._next_round = loop.create_future()
            if self._rounds is None or self._rounds.done():
                self._rounds = loop.create_task(self._run_rounds())
        # shield: a caller that goes away must not cancel the round the others wait for
        await asyncio.shield(self._next_round)

    async def _run_rounds(self) -> None:
        loop = asyncio.get_running_loop()
        while self._next_round is not None:
            this_round, self._next_round = self._next_round, None
            try:
                await loop.run_in_executor(None, check_room, self._settings)
            except Exception as error:
                this_round.set_exception(error)
                this_round.exception()  # every waiter re-raises it; none left must not log a warning
            else:
                this_round.set_result(None)


def ledger_storage_problem(error: BaseException, settings: Settings | None) -> str | None:
    """What to tell the caller when a ledger write failed for want of disk room or permission; None
    when `error` is some other database failure (the database down: a 503, not a 507)."""
    original = getattr(error, "orig", None) or error
    text = str(original).strip()
    if getattr(original, "pgcode", None) != _PG_DISK_FULL and not any(
        marker in text.lower() for marker in _NO_ROOM
    ):
        return None
    first_line = text.splitlines()[0] if text else type(original).__name__
    where = _ledger_location(settings)
    return f"the job database cannot store anything: its disk is full or read-only ({where}: {first_line})"


def _ledger_location(settings: Settings | None) -> str:
    if settings is None:
        return "the ledger"
    url = settings.resolved_database_url()
    try:
        parsed = make_url(url)
    except ArgumentError:
        return "the ledger"
    if parsed.get_backend_name() == "sqlite":
        return f"SQLite file {parsed.database}"
    return f"{parsed.get_backend_name()} database {parsed.database} on {parsed.host}"
