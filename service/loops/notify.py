"""The notify loop: the outbox's notices become deliveries, and due deliveries are sent (webhooks).

Each pass, every TORCHYARD_NOTIFY_INTERVAL_S:
1. fan-out (one transaction): notices -> one delivery per matching subscription, the notices deleted
   (service.domain.outbox.fan_out; each notice in a savepoint of its own);
2. send: due deliveries claimed under a lease and COMMITTED; then, with no transaction open, each is
   POSTed from a small pool of threads (a slow receiver holds one thread up to its timeouts, never
   the pass or another's delivery); then each outcome is settled in a short transaction of its own.
Before each POST the URL is checked again against the host lists, its host resolved again (DNS may
have changed since the subscription was made); a refusal fails the delivery for good. Redirects are
not followed: a 3xx is a failed try ("redirects are refused"), as they would lead past the lists.

Every replica runs one; the lease keeps two from sending one delivery (service.domain.outbox).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
from sqlalchemy.engine import Engine

from service.bulkhead import Bulkhead
from service.config import Settings
from service.domain import outbox, webhook_events, webhook_hosts
from service.domain.notifications import REMOVED, rules_of
from service.ledger.db import session_scope, write_scope

log = logging.getLogger(__name__)

SENDERS = 8  # deliveries sent at once by one replica
MAX_BODY_READ = 4096  # bytes of a receiver's answer read (for the error text)


class Notifier:
    def __init__(self, engine: Engine, settings: Settings) -> None:
        self._engine = engine
        self._settings = settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchyard-notify", daemon=True)
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.fan_out_guard = Bulkhead(outbox.FAN_OUT)
        self.send_guard = Bulkhead("webhook delivery")
        self.delivered = self.failed_tries = 0  # since start, for /metrics and tests
        timeout = httpx.Timeout(settings.webhook_read_timeout_s, connect=settings.webhook_connect_timeout_s)
        # No proxies from the environment (trust_env): the host lists judge the receiver, not a proxy.
        self._client = httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False)
        self._pool = ThreadPoolExecutor(SENDERS, thread_name_prefix="torchyard-webhook")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def run_pass(self) -> int:
        """One fan-out and one round of sends; returns how many deliveries were tried."""
        # A quiet ledger costs a read, not a write turn (SQLite's one writer is the intake's first).
        with session_scope(self._engine) as session:
            notices, due = outbox.work_waiting(session)
        if notices:
            with write_scope(self._engine) as session:
                outbox.fan_out(session, self._settings.dashboard_url(), self.fan_out_guard)
            due = True
        if not due:
            return 0
        with write_scope(self._engine) as session:
            claimed = outbox.claim_due(session, self.me, self._lease_s())
        # Committed: the lease is ours, and no transaction is open while we call out.
        list(self._pool.map(self._deliver, claimed))
        return len(claimed)

    def _deliver(self, claimed: outbox.Claimed) -> None:
        result = self.send_guard.guarded(claimed.id, lambda: self._send(claimed))
        outcome = result if isinstance(result, outbox.Outcome) else outbox.Outcome(False, error=result.error)
        if outcome.delivered:
            self.delivered += 1
        else:
            self.failed_tries += 1
            log.info("webhook delivery %s (try %d) failed: %s", claimed.delivery_id, claimed.attempts,
                     outcome.error)  # fmt: skip
        most = self._settings.webhook_max_attempts
        with write_scope(self._engine) as session:  # on SQLite, a turn among this process's writers
            outbox.settle(session, claimed, self.me, outcome, max_attempts=most, backoff=self._backoff)

    def _send(self, claimed: outbox.Claimed) -> outbox.Outcome:
        if claimed.secret is None:
            return outbox.Outcome(False, error=REMOVED, permanent=True)
        try:
            webhook_hosts.check_url(claimed.url, rules_of(self._settings))
        except webhook_hosts.Unresolved as unresolved:  # DNS may be back on the next try
            return outbox.Outcome(False, error=str(unresolved))
        except webhook_hosts.Refused as refused:
            return outbox.Outcome(False, error=f"refused: {refused}", permanent=True)
        body = webhook_events.body_bytes(claimed.payload)
        headers = webhook_events.headers(claimed.secret, body, claimed.delivery_id, claimed.event)
        try:
            with self._client.stream("POST", claimed.url, content=body, headers=headers) as response:
                return _outcome(response)
        except httpx.HTTPError as error:
            return outbox.Outcome(False, error=f"{type(error).__name__}: {error}")

    def _backoff(self, tries: int) -> float:
        wait = self._settings.webhook_backoff_s * 2 ** (tries - 1)
        return float(min(self._settings.webhook_max_backoff_s, wait))

    def _lease_s(self) -> float:
        """Long enough for a whole try (the host resolved, connect, read), with room to spare."""
        settings = self._settings
        return 2 * (settings.webhook_connect_timeout_s + settings.webhook_read_timeout_s) + 30

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.run_pass()
            except Exception:  # the loop must outlive a bad pass (database down, ...)
                log.exception("notify pass failed; trying again later")
            self._stop.wait(self._settings.notify_interval_s)


def _outcome(response: httpx.Response) -> outbox.Outcome:
    """How a receiver answered: 2xx delivered; anything else a failed try, with the first bytes of
    its answer (never all of them: a receiver could send gigabytes)."""
    status = response.status_code
    if 200 <= status < 300:
        return outbox.Outcome(True, status=status)
    if 300 <= status < 400:
        where = response.headers.get("location", "")
        return outbox.Outcome(False, status=status, error=f"{status}: redirects are refused ({where})")
    read = b""
    for chunk in response.iter_bytes():
        read += chunk
        if len(read) >= MAX_BODY_READ:
            break
    text = read[:MAX_BODY_READ].decode(errors="replace")
    return outbox.Outcome(False, status=status, error=f"{status}: {text}")
