"""The notify loop: the outbox's notices become deliveries, and due deliveries are sent (webhooks).

Each pass (every TORCHYARD_NOTIFY_INTERVAL_S, or sooner when a send ends):
1. fan-out, in chunks of TORCHYARD_NOTIFY_FAN_OUT_CHUNK subscriptions, each chunk a write
   transaction of its own (service.domain.outbox.fan_out), a few chunks a pass;
2. claims: as many due deliveries as there are free senders, round-robin by owner and none past an
   owner's share in flight (service.domain.deliveries.claim_fairly), under a lease, COMMITTED;
3. sends: each handed to a sender thread, and the pass goes on: no pass waits for a send. A send
   has a total deadline (service.loops.webhook_send); its sender settles its outcome in a short
   transaction of its own as soon as it ends.
So one user's slow receiver holds at most their share of the senders for at most the deadline, and
never the loop, another user's delivery, or (through the lease) another replica.

Every replica runs one; the lease keeps two from sending one delivery (service.domain.deliveries).
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor, wait

from sqlalchemy.engine import Engine

from service.bulkhead import Bulkhead
from service.config import Settings
from service.domain import deliveries, outbox
from service.domain.deliveries import Claimed, Outcome
from service.domain.notifications import rules_of
from service.ledger.db import session_scope, write_scope
from service.loops import webhook_send

log = logging.getLogger(__name__)

SERVICE_FAULT = "the service failed sending it"
FAN_OUT_CHUNKS_PER_PASS = 10  # then the pass goes on to sending; the next pass goes on fanning out


class Notifier:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self._engine = engine
        self._settings = settings
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchyard-notify", daemon=True)
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.fan_out_guard = Bulkhead(outbox.FAN_OUT)
        self.send_guard = Bulkhead("webhook delivery")
        self.delivered = self.failed_tries = 0  # since start, for /metrics and tests
        self._limits = webhook_send.Limits(
            connect_s=settings.webhook_connect_timeout_s,
            read_s=settings.webhook_read_timeout_s,
            total_s=settings.webhook_total_timeout_s,
        )
        self._tls = ssl.create_default_context()
        self._pool = ThreadPoolExecutor(settings.webhook_senders, thread_name_prefix="torchyard-webhook")
        self._in_flight: set[Future[None]] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run_pass(self) -> int:
        """Some fan-out and one round of claims; returns how many sends it started (it waits for none)."""
        # A quiet ledger costs a read, not a write turn (SQLite's one writer is the intake's first).
        with session_scope(self._engine) as session:
            notices, due = outbox.notices_waiting(session), deliveries.any_due(session)
        if notices:
            self._fan_out()
            due = True
        free = self._settings.webhook_senders - self.in_flight()
        if not due or free <= 0:
            return 0
        with write_scope(self._engine) as session:
            claimed = deliveries.claim_fairly(
                session, self.me, self._lease_s(), free, self._settings.webhook_owner_senders
            )
        # Committed: the leases are ours, and no transaction is open while we call out.
        for one in claimed:
            future = self._pool.submit(self._deliver, one)
            with self._lock:
                self._in_flight.add(future)
            future.add_done_callback(self._done)
        return len(claimed)

    def in_flight(self) -> int:
        with self._lock:
            return len(self._in_flight)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until every send started so far has been settled (tests; a stop needs none)."""
        with self._lock:
            started = list(self._in_flight)
        wait(started, timeout=timeout)

    def _fan_out(self) -> None:
        chunk = self._settings.notify_fan_out_chunk
        for _ in range(FAN_OUT_CHUNKS_PER_PASS):
            # One chunk holds the writer, then lets it go: a writer that asked meanwhile goes before
            # the next chunk (the turns are taken in order: service.ledger.db.TurnLock).
            with write_scope(self._engine) as session:
                worked = outbox.fan_out(session, self._settings.dashboard_url(), self.fan_out_guard, chunk)
            if not worked:
                return

    def _done(self, future: Future[None]) -> None:
        with self._lock:
            self._in_flight.discard(future)
        self._wake.set()  # a sender is free: the next pass need not wait out the interval

    def _deliver(self, claimed: Claimed) -> None:
        result = self.send_guard.guarded(claimed.id, lambda: self._send(claimed))
        outcome = result if isinstance(result, Outcome) else Outcome(False, error=SERVICE_FAULT)
        if outcome.delivered:
            self.delivered += 1
        else:
            self.failed_tries += 1
            log.info("webhook delivery %s (try %d) failed: %s", claimed.delivery_id, claimed.attempts,
                     outcome.error)  # fmt: skip
        most = self._settings.webhook_max_attempts
        with write_scope(self._engine) as session:  # on SQLite, a turn among this process's writers
            deliveries.settle(session, claimed, self.me, outcome, max_attempts=most, backoff=self._backoff)

    def _send(self, claimed: Claimed) -> Outcome:
        return webhook_send.send(claimed, rules_of(self._settings), self._limits, self._tls)

    def _backoff(self, tries: int) -> float:
        wait_s = self._settings.webhook_backoff_s * 2 ** (tries - 1)
        return float(min(self._settings.webhook_max_backoff_s, wait_s))

    def _lease_s(self) -> float:
        """Longer than a whole try (the host resolved, then the total deadline), with room to spare."""
        settings = self._settings
        return 2 * (settings.webhook_connect_timeout_s + settings.webhook_total_timeout_s) + 30

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.run_pass()
            except Exception:  # the loop must outlive a bad pass (database down, ...)
                log.exception("notify pass failed; trying again later")
            self._wake.wait(self._settings.notify_interval_s)
