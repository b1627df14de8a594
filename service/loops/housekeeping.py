"""The housekeeping loop: retention passes (every `gc_interval_s`, the first at start, which also
finishes a pass a restart cut short) with the collection of unused code snapshots and of the folders
of SLURM arrays whose jobs have ended, the pruning of old webhook deliveries (a chunk a write
transaction) and the merging of the name index's segments (SQLite), and, between them, the sizes of
the folders of jobs that ended.

Every replica runs one; the work is idempotent (a folder another replica moved is simply gone).
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.engine import Engine

from service.bulkhead import Bulkhead
from service.config import Settings
from service.domain import code_store, deliveries, retention
from service.ledger import name_index
from service.ledger.db import session_scope, write_scope

log = logging.getLogger(__name__)

MEASURE_EVERY_S = 10.0  # an ended job's size shows within this long


class Housekeeper:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self._engine = engine
        self._settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchyard-housekeeping", daemon=True)
        self.freed_bytes = 0  # by this process's passes, for /metrics
        self.bulkhead = Bulkhead(retention.RETENTION)
        self.last_pass_at = 0.0  # time.time() of the last pass that completed

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def run_pass(self) -> retention.PassReport:
        report = retention.run_pass(self._engine, self._settings, guard=self.bulkhead)
        self.freed_bytes += report.freed
        self._collect_code()
        retention.prune_array_folders(self._engine, self._settings)
        self.prune_deliveries()
        name_index.merge_segments(self._engine, stop=self._stop)
        self.last_pass_at = time.time()
        return report

    def prune_deliveries(self) -> int:
        """Delivered and failed deliveries older than TORCHYARD_KEEP_DELIVERIES_DAYS, a chunk a write
        transaction (SQLite's one writer is held a chunk's time at most); returns how many."""
        pruned = 0
        while not self._stop.is_set():
            with write_scope(self._engine) as session:
                chunk = deliveries.prune(session, self._settings.keep_deliveries_days)
            pruned += chunk
            if chunk < deliveries.PRUNE_CHUNK:
                break
        if pruned:
            log.info("pruned %d old webhook deliveries", pruned)
        return pruned

    def _collect_code(self) -> None:
        """Code snapshots no unfinished job uses, older than TORCHYARD_CODE_KEEP_H: their rows, then
        (after the commit) their files, as `torchyard code gc` does."""
        with session_scope(self._engine) as session:
            removed = code_store.collect(session, self._settings)
        code_store.remove_files(self._settings, removed)
        if removed:
            log.info("collected %d unused code snapshot(s)", len(removed))

    def _run(self) -> None:
        next_pass = time.monotonic()
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_pass:
                    next_pass = time.monotonic() + self._settings.gc_interval_s
                    self.run_pass()
                retention.measure_ended(self._engine, self._settings, self.bulkhead)
            except Exception:  # the loop must outlive a bad pass (database down, a sick disk, ...)
                log.exception("housekeeping failed; trying again later")
            self._stop.wait(min(MEASURE_EVERY_S, max(0.0, next_pass - time.monotonic())))
