"""Rendered list pages, keyed by the ledger clock: a poll of an unchanged ledger costs one tiny read.

Every commit that changes a job bumps the clock (service.ledger.clock), and the clock lives in the
database, so a page cached under one clock value is exactly what a fresh query would return, on every
replica. Nothing here can go stale; entries for old clock values simply age out of the LRU.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Hashable

from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from service.ledger.clock import LedgerVersion, read_version_on


class PageCache:
    def __init__(self, max_entries: int = 256) -> None:
        self._max = max_entries
        self._pages: OrderedDict[Hashable, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            body = self._pages.get(key)
            if body is None:
                self.misses += 1
                return None
            self._pages.move_to_end(key)
            self.hits += 1
            return body

    def put(self, key: Hashable, body: bytes) -> None:
        with self._lock:
            self._pages[key] = body
            self._pages.move_to_end(key)
            while len(self._pages) > self._max:
                self._pages.popitem(last=False)


class ClockReader:
    """Reads the ledger clock on the event loop through one connection of its own.

    Polls read the clock on every request; a thread-pool hop for that costs more than the read. But
    an event loop must never wait on the shared pool (threads that hold its connections may need
    the loop to finish), so this reader keeps one connection outside the pool's contention. Only the
    event-loop thread uses it, and each read ends its transaction so the next one sees new commits.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._connection: Connection | None = None

    def read(self) -> LedgerVersion:
        for attempt in (1, 2):
            connection = self._connect()
            try:
                version = read_version_on(connection)
                connection.rollback()  # end the read transaction: the next read sees new commits
                return version
            except DBAPIError:
                self.close()  # a broken connection (database restarted): one fresh try
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _connect(self) -> Connection:
        if self._connection is None or self._connection.closed:
            self._connection = self._engine.connect()
        return self._connection

    def close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(DBAPIError):
                self._connection.close()
            self._connection = None
