"""What one running service holds: engine, backends, the intake writer and the loops."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine

from service.accounts import announce
from service.api.fragments import Fragments, LastPages
from service.api.reader import LedgerReader
from service.api.watch import JobWatch
from service.api.writers_first import WritersFirst
from service.backends import make_backends
from service.backends.base import Backend
from service.config import Settings
from service.domain.auth import TokenCheck
from service.domain.captures import Captures
from service.domain.code_store import CodeStore
from service.domain.code_uploads import CodeUploads
from service.domain.login import LoginGuard
from service.domain.quotas import QuotaBook
from service.domain.storage import RoomCheck, prepare_data_dir
from service.domain.submit import Admission
from service.jobfs import jobs_root
from service.ledger.clock import on_stamped_commit
from service.ledger.db import make_engine, migrate
from service.loops.dispatch import Dispatcher
from service.loops.housekeeping import Housekeeper
from service.loops.intake import JobIntake
from service.loops.notify import Notifier
from service.loops.reconcile import Reconciler
from service.loops.sweep_search import SweepSearch

GIL_TURN_S = 0.0005


@dataclass
class Runtime:
    settings: Settings
    engine: Engine
    backends: dict[str, Backend]
    intake: JobIntake
    dispatcher: Dispatcher
    reconciler: Reconciler
    reader: LedgerReader  # the clock and job stamps, on the event loop
    tokens: TokenCheck
    quotas: QuotaBook
    admission: Admission
    job_watch: JobWatch  # long polls on one job (GET ?wait_s=)
    housekeeper: Housekeeper  # retention passes and folder sizes
    code: CodeStore
    code_uploads: CodeUploads  # permission, rate, room and per-user bytes before the store
    notifier: Notifier  # webhooks: the outbox's notices delivered
    captures: Captures  # stacks captures, for requests and the watchdog, on threads of their own
    logins: LoginGuard  # failed logins per source and user, and the MUNGE decodes under way
    fragments: Fragments = field(default_factory=Fragments)  # each job's JSON per version
    pages: LastPages = field(default_factory=LastPages)  # list pages while the clock stands still
    writers: WritersFirst = field(default_factory=WritersFirst)  # polls wait for POSTs in flight
    switch_interval_before: float = field(default=0.0, init=False, repr=False)  # restored by stop()

    @classmethod
    def build(cls, settings: Settings, backends: dict[str, Backend] | None = None) -> Runtime:
        prepare_data_dir(settings)
        engine = make_engine(settings.resolved_database_url())
        migrate(engine)
        announce(settings)
        backends = backends if backends is not None else make_backends(settings)
        dispatcher = Dispatcher(engine, backends, settings)
        intake = JobIntake(engine, str(jobs_root(settings)), dispatcher.wake)
        captures = Captures(engine, backends, settings)
        search = SweepSearch(engine, intake.insert_trials, dispatcher.wake)
        reconciler = Reconciler(engine, backends, captures, settings.ending_files_grace_s, search)
        tokens = TokenCheck(engine, settings.token_cache_s)
        quotas = QuotaBook(engine, settings)
        reader = LedgerReader(engine)
        code = CodeStore(settings)
        room = RoomCheck(settings)  # one for jobs and uploads: their checks share rounds
        admission = Admission(settings, engine, backends, quotas, room, intake, code, reader.replayed)
        job_watch = JobWatch(settings.max_long_polls, settings.max_long_polls_per_user)
        runtime = cls(
            settings,
            engine,
            backends,
            intake,
            dispatcher,
            reconciler,
            reader,
            tokens,
            quotas,
            admission,
            job_watch,
            Housekeeper(engine, settings),
            code,
            CodeUploads(settings, engine, code, quotas, room),
            Notifier(engine, settings),
            captures,
            LoginGuard(settings.max_failed_logins),
        )
        on_stamped_commit(engine, runtime.job_watch.changed)
        return runtime

    def start(self) -> None:
        # The writing threads (intake, dispatch, reconcile) take the GIL back after every statement;
        # while readers keep the event loop busy, each take waited out the 5 ms default switch
        # interval, and a POST's group commit waited out many of them (bench.poll --busy: POST
        # latency). Shorter turns keep writers first.
        self.switch_interval_before = sys.getswitchinterval()
        sys.setswitchinterval(GIL_TURN_S)
        self.intake.start()
        self.dispatcher.start()
        self.reconciler.start()
        self.housekeeper.start()
        self.notifier.start()
        self.dispatcher.wake()  # jobs queued before a restart go out now

    def stop(self) -> None:
        self.intake.stop()
        self.dispatcher.stop()
        self.reconciler.stop()
        self.captures.stop()  # after the watchdog's last tick
        self.housekeeper.stop()
        self.notifier.stop()
        for backend in self.backends.values():
            backend.close()
        self.reader.close()
        self.engine.dispose()
        if self.switch_interval_before > 0:  # started: the process may go on without a service
            sys.setswitchinterval(self.switch_interval_before)
