"""Per-user limits: how big one job may be, how many may be unfinished, how fast one may submit
(jobs, sweeps and code uploads share that rate).

Defaults come from Settings; a `UserQuota` row overrides them for one user (`torchyard quota set`).
Job size over a limit is 403 (asking again will not help), and so is a submission of more jobs
(a sweep's trials) than the user may have unfinished at all; too many unfinished jobs or too many
submissions a minute is 429 with Retry-After (it will pass later).

Each limit has one owner. A user's limits are read from the ledger once every REFRESH_S per replica,
and the submissions of the last minute are counted in memory (per replica: the rate is a replica's
protection, not an account). The unfinished jobs are counted by the ledger alone, in the transaction
that stores the new ones, under a lock per user (service.loops.intake, `count_unfinished_of`): the
count is exact across replicas, a cancel frees room at once, and no second count in memory can say
otherwise.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from sqlalchemy import String, bindparam, func, select
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from service.config import Settings
from service.errors import Forbidden, LimitExceeded
from service.ledger.models.access import UserQuota
from service.ledger.models.jobs import Job
from service.states import JobState, is_terminal
from worker.spec import Resources

UNFINISHED = [state.value for state in JobState if not is_terminal(state)]
WINDOW_S = 60.0
REFRESH_S = 2.0  # how often a replica reads a user's limits again


@dataclass(frozen=True)
class Limits:
    max_active_jobs: int
    max_submissions_per_minute: int
    max_nodes: int
    max_tasks: int
    max_gpus: int
    keep_finished_days: float  # retention (service.domain.retention); 0: for ever


class RetryLater(LimitExceeded):
    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManyUnfinished(RetryLater):
    """Refused for the count of the user's unfinished jobs: the one refusal after counting that gives
    the submission's slot of the minute back (it says "wait for a job to end", not "slow down")."""


@dataclass
class _Book:
    limits: Limits
    fetched_at: float
    submissions: deque[float] = field(default_factory=deque)  # when, in the last minute


def limits_for(session: Session, user: str, settings: Settings) -> Limits:
    row = session.get(UserQuota, user) or UserQuota(username=user)

    def pick(override: int | None, default: int) -> int:
        return default if override is None else override

    return Limits(
        max_active_jobs=pick(row.max_active_jobs, settings.max_active_jobs_per_user),
        max_submissions_per_minute=pick(row.max_submissions_per_minute, settings.max_submissions_per_minute),
        max_nodes=pick(row.max_nodes, settings.max_nodes),
        max_tasks=pick(row.max_tasks, settings.max_tasks_per_job),
        max_gpus=pick(row.max_gpus, settings.max_gpus_per_job),
        keep_finished_days=(
            settings.keep_finished_days if row.keep_finished_days is None else row.keep_finished_days
        ),
    )


def count_unfinished_of(session: Session, users: Collection[str]) -> dict[str, int]:
    """Each user's unfinished jobs, in one query however many users: the intake counts every owner
    of a batch in the commit that stores it, and a query each made its commits slow (intake)."""
    # Core, and built once: the intake counts in every commit that admits jobs under a limit.
    counts = dict.fromkeys(users, 0)
    rows = session.connection().execute(_COUNT_UNFINISHED, {"owners": list(users)})
    counts.update({owner: int(count) for owner, count in rows})
    return counts


_COUNT_UNFINISHED = (
    select(col(Job.owner), func.count())
    .where(col(Job.owner).in_(bindparam("owners", expanding=True)), col(Job.state).in_(UNFINISHED))
    .group_by(col(Job.owner))
)


def too_many_unfinished(active: int, limit: int, asked: int = 1) -> TooManyUnfinished:
    more = "" if asked == 1 else f" and ask for {asked} more"
    return TooManyUnfinished(
        f"you have {active} unfinished jobs{more}, your limit is {limit}; submit more when some finish",
        retry_after_s=REFRESH_S,
    )


def check_job_size(resources: Resources, limits: Limits) -> None:
    tasks = resources.world_size
    gpus = resources.nodes * resources.gpus_per_node
    for what, value, maximum, field_name in (
        ("nodes", resources.nodes, limits.max_nodes, "resources.nodes"),
        ("tasks (nodes x tasks_per_node)", tasks, limits.max_tasks, "resources.tasks_per_node"),
        ("GPUs (nodes x gpus_per_node)", gpus, limits.max_gpus, "resources.gpus_per_node"),
    ):
        if value > maximum:
            raise Forbidden(f"this job asks for {value} {what}; your limit is {maximum}", field=field_name)


def _check_rate(book: _Book, now: float) -> None:
    """RetryLater when the user's submissions of the last minute have reached their limit."""
    while book.submissions and book.submissions[0] <= now - WINDOW_S:
        book.submissions.popleft()
    if len(book.submissions) >= book.limits.max_submissions_per_minute:
        wait = book.submissions[0] + WINDOW_S - now
        raise RetryLater(
            f"over your limit of {book.limits.max_submissions_per_minute} submissions per minute (jobs, "
            f"sweeps and code uploads together); try again in {wait:.0f} s",
            retry_after_s=wait,
        )


class QuotaBook:
    """One replica's view of its users' limits and of their submissions of the last minute. `refresh`
    runs in a worker thread, the rest on the event loop."""

    def __init__(self, engine: Engine, settings: Settings, refresh_s: float = REFRESH_S) -> None:
        self._engine = engine
        self._settings = settings
        self._refresh_s = refresh_s
        self._books: dict[str, _Book] = {}
        self._lock = threading.Lock()  # refresh runs in worker threads, the rest on the event loop

    def needs_refresh(self, user: str) -> bool:
        book = self._books.get(user)
        return book is None or time.monotonic() - book.fetched_at > self._refresh_s

    def refresh(self, user: str) -> None:
        with Session(self._engine) as session:
            limits = limits_for(session, user, self._settings)
        with self._lock:
            book = self._books.setdefault(user, _Book(limits, time.monotonic()))
            book.limits, book.fetched_at = limits, time.monotonic()

    def limits(self, user: str) -> Limits:
        return self._books[user].limits

    def admit(self, user: str, resources: Resources, jobs: int = 1, jobs_field: str | None = None) -> None:
        """Take a slot of the minute for one submission of `jobs` jobs (a sweep's trials, which the
        request's `jobs_field` makes), or raise: Forbidden for size (of one job, or of a submission of
        more jobs than the user may ever have unfinished), RetryLater for the rate (a sweep is one
        submission). The unfinished jobs are the intake's to count, in its commit."""
        with self._lock:
            book = self._books[user]
            check_job_size(resources, book.limits)
            if jobs > book.limits.max_active_jobs:  # a Retry-After would be answered with 429 for ever
                asked = "1 job" if jobs == 1 else f"{jobs} jobs"
                raise Forbidden(
                    f"makes {asked} at once, above your limit of {book.limits.max_active_jobs} unfinished "
                    "jobs: it can never be admitted whole (make fewer, or ask for a higher limit)",
                    field=jobs_field,
                )
            self._take_slot(book)

    def admit_upload(self, user: str) -> None:
        """Count a code upload against the user's submissions of the minute, or raise RetryLater: an
        upload costs the service what a submission does (a body read, an archive checked, a file
        written), and one limit is simpler to know than two."""
        with self._lock:
            self._take_slot(self._books[user])

    def give_back_slot(self, user: str) -> None:
        """A submission that cost nothing after all: a replay of a stored job, or a refusal for the
        unfinished-jobs count ("wait for a job to end", not "slow down"). Any other refusal keeps its
        slot, for what it cost (service.domain.submit) and so that refusals cannot be asked for
        without end."""
        with self._lock:
            book = self._books.get(user)
            if book is not None and book.submissions:
                book.submissions.pop()

    @staticmethod
    def _take_slot(book: _Book) -> None:
        now = time.monotonic()
        _check_rate(book, now)
        book.submissions.append(now)


# PostgreSQL: the advisory lock of each of `keys`, in their order (UnfinishedCount)
_QUOTA_KEYS = (
    func.unnest(bindparam("keys", type_=ARRAY(String)))
    .table_valued("key", with_ordinality="n")
    .render_derived()
)
_LOCK_QUOTAS = select(func.pg_advisory_xact_lock(func.hashtext(_QUOTA_KEYS.c.key))).order_by(_QUOTA_KEYS.c.n)


class UnfinishedCount:
    """The owners' unfinished jobs, counted once per batch under a lock per owner, plus those the
    batch adds. On PostgreSQL the lock is a transaction-scoped advisory lock, taken in name order so
    two replicas' batches cannot deadlock. On SQLite it is the database's one write lock, which the
    write scope took at its start (service.ledger.db).

    Two statements for the whole batch, the locks then the counts (a count in the locking statement
    would read from a snapshot taken before the locks were granted): two for each owner made a
    commit under many submitting users several times longer (tests/integration/test_load.py).

    The one count of a user's unfinished jobs: admission counts none (service.domain.submit)."""

    def __init__(self, session: Session, owners: set[str]) -> None:
        self._counts: dict[str, int] = {}
        if not owners:
            return
        connection = session.connection()
        if connection.dialect.name == "postgresql":
            connection.execute(_LOCK_QUOTAS, {"keys": [f"quota:{owner}" for owner in sorted(owners)]})
        self._counts = count_unfinished_of(session, owners)

    def take(self, owner: str, limit: int, count: int = 1) -> Exception | None:
        """Count `count` more jobs of `owner`, or the refusal when that would pass `limit`."""
        if self._counts[owner] + count > limit:
            return too_many_unfinished(self._counts[owner], limit, asked=count)
        self._counts[owner] += count
        return None
