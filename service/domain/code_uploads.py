"""Admission for code uploads: what one user's uploads may take of a shared service.

An upload costs the service what a job submission does, and more: a body of up to
TORCHYARD_MAX_CODE_BYTES received, an archive decompressed to be checked, files written that stay for
days. So before its body is read it must be allowed (the allow-code permission), find a place among
the uploads in flight (TORCHYARD_MAX_UPLOADS_IN_FLIGHT_PER_USER, and TORCHYARD_MAX_UPLOADS_IN_FLIGHT
for everyone: 429 past either, for each holds a connection and a staging file), count against the
user's submissions of the minute (one limit for jobs, sweeps and uploads: 429 past it) and find room
in the data directory (507, as a job does).

The body is never held in memory: it is streamed, a chunk at a time, to a file of the store's
staging folder, hashed and counted as it comes, and cut with 413 past TORCHYARD_MAX_CODE_BYTES (the
request gate cuts it too, whatever the route does). Then the bytes the user's snapshots would hold,
the archive's and its unpacked files', are checked against TORCHYARD_MAX_CODE_BYTES_PER_USER (403
naming `archive`) before it is stored; a snapshot they have already adds nothing, so uploading it
again works at the limit.

The streaming, the per-user check and the write happen under the user's lock, one upload at a time
on a replica, so two at once cannot both fit under the limit (replicas sharing a ledger may each add
one at the same moment); the check and the write are one transaction (the caller's request does not
own this one: the upload is committed before it is answered, as the intake commits a job).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import uuid
import weakref
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.engine import Engine

from service.config import Settings
from service.domain.auth import Principal
from service.domain.code_store import CodeStore, Staged, require_code_permission
from service.domain.quotas import QuotaBook, RetryLater
from service.domain.storage import RoomCheck
from service.errors import TooLarge
from service.ledger.db import session_scope
from service.ledger.models.code_snapshots import CodeSnapshotPublic

BUSY_RETRY_S = 5.0  # what a refusal for the uploads in flight tells the client to wait


@dataclass
class CodeUploads:
    """The parts an upload needs, built once by the Runtime (the quotas and room check are admission's)."""

    settings: Settings
    engine: Engine
    store: CodeStore
    quotas: QuotaBook
    room: RoomCheck
    _turns: weakref.WeakValueDictionary[str, asyncio.Lock] = field(
        default_factory=weakref.WeakValueDictionary, init=False, repr=False
    )  # a user's uploads, one at a time
    _in_flight: Counter[str] = field(default_factory=Counter, init=False, repr=False)  # on the event loop

    async def upload(self, user: Principal, body: AsyncIterator[bytes]) -> tuple[CodeSnapshotPublic, bool]:
        """Check, count and store one upload, whose `body` is read only once it may be; True when the
        snapshot is new to the user."""
        require_code_permission(user)
        with self._a_place_in_flight(user.user):
            if self.quotas.needs_refresh(user.user):
                await asyncio.to_thread(self.quotas.refresh, user.user)
            self.quotas.admit_upload(user.user)
            await self.room.check()
            turn = self._turns.setdefault(user.user, asyncio.Lock())  # kept while someone holds it
            async with turn:
                staged = await self._stream_to_staging(body)
                try:
                    return await asyncio.to_thread(self._store, user, staged)
                finally:
                    staged.path.unlink(missing_ok=True)

    def in_flight(self, user: str) -> int:
        """The user's uploads admitted and not yet answered."""
        return self._in_flight[user]

    @contextlib.contextmanager
    def _a_place_in_flight(self, user: str) -> Iterator[None]:
        """RetryLater (429) past the uploads in flight a user, or everyone, may have."""
        mine, most_mine = self._in_flight[user], self.settings.max_uploads_in_flight_per_user
        everyone, most = self._in_flight.total(), self.settings.max_uploads_in_flight
        if mine >= most_mine:
            raise RetryLater(
                f"you have {mine} code uploads in flight, your limit is {most_mine} "
                "(TORCHYARD_MAX_UPLOADS_IN_FLIGHT_PER_USER): send the next when one is answered",
                retry_after_s=BUSY_RETRY_S,
            )
        if everyone >= most:
            raise RetryLater(
                f"this service has {everyone} code uploads in flight, its limit is {most} "
                "(TORCHYARD_MAX_UPLOADS_IN_FLIGHT)",
                retry_after_s=BUSY_RETRY_S,
            )
        self._in_flight[user] += 1
        try:
            yield
        finally:
            self._in_flight[user] -= 1
            if not self._in_flight[user]:
                del self._in_flight[user]

    async def _stream_to_staging(self, body: AsyncIterator[bytes]) -> Staged:
        """The body in a new staging file, hashed and counted a chunk at a time: 413 past the limit."""
        most = self.settings.max_code_bytes
        path = await asyncio.to_thread(lambda: self.store.staging() / f"{uuid.uuid4().hex}.upload")
        digest, size = hashlib.sha256(), 0
        try:
            with await asyncio.to_thread(_new_file, path) as out:
                async for chunk in body:
                    size += len(chunk)
                    if size > most:
                        raise TooLarge(f"the archive is over TORCHYARD_MAX_CODE_BYTES ({most} bytes)")
                    digest.update(chunk)
                    await asyncio.to_thread(out.write, chunk)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        return Staged(path, digest.hexdigest(), size)

    def _store(self, user: Principal, staged: Staged) -> tuple[CodeSnapshotPublic, bool]:
        with session_scope(self.engine) as session:
            return self.store.add(session, user, staged, most_held=self.settings.code_bytes_per_user())


def _new_file(path: Path) -> BinaryIO:
    return path.open("xb")
