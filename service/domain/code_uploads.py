"""Admission for code uploads: what one user's uploads may take of a shared service.

An upload costs the service what a job submission does, and more: a body of up to
TORCHYARD_MAX_CODE_BYTES read, an archive decompressed to be checked, files written that stay for
days. So before its body is read it must be allowed (the allow-code permission), count against the
user's submissions of the minute (one limit for jobs, sweeps and uploads: 429 past it) and find room
in the data directory (507, as a job does). Once read, the bytes the user's snapshots would then hold
are checked against TORCHYARD_MAX_CODE_BYTES_PER_USER (403 naming `archive`) before anything is
written; a snapshot they have already adds nothing, so uploading it again works at the limit.

The per-user check and the write are one transaction (the caller's request does not own this one:
the upload is committed before it is answered, as the intake commits a job). A user's uploads go one
at a time on a replica, so two at once cannot both fit under the limit; replicas sharing a ledger may
each add one at the same moment.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from service.config import Settings
from service.domain.auth import Principal
from service.domain.code_store import CodeStore, require_code_permission
from service.domain.quotas import QuotaBook
from service.domain.storage import RoomCheck
from service.ledger.db import session_scope
from service.ledger.models.code_snapshots import CodeSnapshotPublic


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

    async def upload(
        self, user: Principal, read_body: Callable[[], Awaitable[bytes]]
    ) -> tuple[CodeSnapshotPublic, bool]:
        """Check, count and store one upload, whose body `read_body` reads only once it may be;
        True when the snapshot is new to the user."""
        require_code_permission(user)
        if self.quotas.needs_refresh(user.user):
            await asyncio.to_thread(self.quotas.refresh, user.user)
        self.quotas.admit_upload(user.user)
        await self.room.check()
        data = await read_body()
        turn = self._turns.setdefault(user.user, asyncio.Lock())  # kept while someone holds it
        async with turn:
            return await asyncio.to_thread(self._store, user, data)

    def _store(self, user: Principal, data: bytes) -> tuple[CodeSnapshotPublic, bool]:
        with session_scope(self.engine) as session:
            return self.store.add(session, user, data, most_held=self.settings.code_bytes_per_user())
