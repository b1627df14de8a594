"""The job domain's reads: one job, jobs' stamps and rows by id, list pages, counts. Never imports
FastAPI; the caller owns the transaction.

Creation is service.domain.submit (admission) and service.loops.intake (group commit); cancelling is
service.domain.cancel, a job's events, attempts and metric rows service.domain.history, and a page's
cursor service.domain.cursors.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from sqlalchemy import Integer, Table, bindparam, func, tuple_, union_all
from sqlalchemy.engine import Connection
from sqlalchemy.sql import selectable
from sqlalchemy.sql.elements import BindParameter, ColumnElement
from sqlmodel import Session, col, select
from sqlmodel.sql.expression import Select

from service.backends.base import Backend
from service.domain.auth import Principal
from service.domain.cursors import MAX_ID, decode_cursor, encode_cursor
from service.errors import InvalidRequest, NotFound
from service.ledger import name_index
from service.ledger.models.columns import UTCDateTime
from service.ledger.models.jobs import Job
from service.ledger.sql import id_chunks
from service.states import JobState

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11

MAX_PAGE = 500
JOB_TABLE: Table = Job.__table__  # type: ignore[attr-defined]
MIN_NAME = name_index.MIN_LENGTH  # `?name=`: the shortest substring its index finds


def get_job(session: Session, job_id: int, viewer: Principal) -> Job:
    """The job, if it exists and `viewer` may see it; another user's job is as missing as no job."""
    job = session.get(Job, job_id)
    if job is None or not viewer.may_see(job.owner):
        raise NotFound(f"job {job_id} not found", field="job_id")
    return job


Stamp = tuple[datetime, str]  # a job's (updated_at, owner)


StampStatement = Select[int | None, datetime, str]


def stamps(connection: Connection, job_ids: Iterable[int]) -> dict[int, Stamp]:
    """These jobs' `updated_at`, restamped by every change to a job, its events or its metrics, and
    their owners (a job deleted meanwhile is left out). service.api.reader makes the same reads
    (stamp_reads) for every poll that arrived in one turn of the event loop at once."""
    found: dict[int, Stamp] = {}
    for statement, values in stamp_reads(job_ids):
        found.update(stamps_found(connection.execute(statement, values)))
    return found


def stamp_reads(job_ids: Iterable[int]) -> Iterator[tuple[StampStatement, dict[str, int]]]:
    """The statements (and their values) that read these jobs' stamps."""
    return _id_reads(stamps_statement, job_ids)


def job_reads(job_ids: Iterable[int]) -> Iterator[tuple[JobRowStatement, dict[str, int]]]:
    """The statements (and their values) that read these jobs whole: rows for jobs_found."""
    return _id_reads(_job_rows_statement, job_ids)


S = TypeVar("S")


def _id_reads(statement: Callable[[int], S], job_ids: Iterable[int]) -> Iterator[tuple[S, dict[str, int]]]:
    """`statement(size)` for each chunk of the ids: a few sizes serve every count, so each statement
    is built (and compiled) once."""
    for chunk in id_chunks(sorted(set(job_ids))):
        size = 1 << (len(chunk) - 1).bit_length()  # a power of two
        values = {f"id{index}": chunk[min(index, len(chunk) - 1)] for index in range(size)}  # last fills
        yield statement(size), values


def _ids_in(size: int) -> ColumnElement[bool]:
    """`job.id IN (:id0, ..., :id{size-1})`: the condition of the statements _id_reads fills."""
    return JOB_TABLE.c.id.in_([bindparam(f"id{index}", type_=Integer) for index in range(size)])


def stamps_found(rows: Iterable[Sequence[Any]]) -> dict[int, Stamp]:
    return {int(job_id): (updated_at, owner) for job_id, updated_at, owner in rows}


@functools.cache
def stamps_statement(size: int) -> StampStatement:
    """(id, updated_at, owner) of up to `size` jobs (_ids_in)."""
    return select(col(Job.id), col(Job.updated_at), col(Job.owner)).where(_ids_in(size))


JobRowStatement: TypeAlias = "selectable.Select[Unpack[tuple[Any, ...]]]"  # Core: the table's columns


@functools.cache
def _job_rows_statement(size: int) -> JobRowStatement:
    """Every column of up to `size` jobs (_ids_in)."""
    return JOB_TABLE.select().where(_ids_in(size))


JobRow = dict[str, Any]  # a job's columns by name: what its public JSON is rendered from
_JOB_FIELDS = [column.key for column in JOB_TABLE.c]


def jobs_found(rows: Iterable[Sequence[Any]]) -> list[JobRow]:
    """The jobs whose rows job_reads read (each column in the table's order). Not Job objects:
    building one cost many times its share of reading a page of changed jobs."""
    return [dict(zip(_JOB_FIELDS, row, strict=True)) for row in rows]


def job_stamp(session: Session, job_id: int, viewer: Principal) -> datetime:
    return visible_stamp(stamps(session.connection(), [job_id]).get(job_id), job_id, viewer)


def visible_stamp(stamp: Stamp | None, job_id: int, viewer: Principal) -> datetime:
    """The job's `updated_at`, if `viewer` may see it; another user's job is as missing as no job."""
    if stamp is None or not viewer.may_see(stamp[1]):
        raise NotFound(f"job {job_id} not found", field="job_id")
    return stamp[0]


@dataclass(frozen=True)
class PageQuery:
    """One list page asked for: filters, where to start (`cursor`), how many."""

    state: tuple[JobState, ...] = ()
    name: str | None = None
    owner: str | None = None  # None: everyone's jobs (an admin)
    cursor: str | None = None
    limit: int = 50
    updated_since: datetime | None = None


@dataclass(frozen=True)
class PageIndex:
    """What a list page holds, before any job is rendered: (id, updated_at) newest first, and the
    cursor of the page after it. A job's (id, updated_at) names one version of its public JSON."""

    entries: list[tuple[int, datetime]]
    next_cursor: str | None


PageStatement = Select[int | None, datetime]
PageRead = tuple[PageStatement, dict[str, Any]]  # a statement and its values
PageRows = Sequence[Sequence[Any]]  # what a PageRead found: (id, updated_at) rows
PageReads = Generator[PageRead, PageRows, "PageIndex"]


def page_index(connection: Connection, query: PageQuery) -> PageIndex:
    """page_reads, made on `connection`."""
    return drive_page_reads(
        page_reads(connection.dialect.name, query), lambda s, v: connection.execute(s, v).all()
    )


def drive_page_reads(
    reads: PageReads, fetch: Callable[[PageStatement, dict[str, Any]], PageRows]
) -> PageIndex:
    """Make a page's reads (page_reads) one after another with `fetch`: the page."""
    try:
        statement, values = next(reads)
        while True:
            statement, values = reads.send(fetch(statement, values))
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def page_reads(dialect: str, query: PageQuery) -> PageReads:
    """Newest first, `limit` at a time; `updated_since` keeps only jobs changed at or after that time.

    Yields the reads the page takes, one after another, and is sent what each found; returns the
    page. Its caller makes them: page_index on a connection, service.api.reader on the event loop
    too. Only ids and stamps (Core): the caller renders (or finds already rendered) each job's
    version. Passed the page's `server_time` (the clock read before this query) as `updated_since`,
    it yields every job changed after that page, plus the jobs of the last commit the page already
    held (`>=`: a tie is sent again rather than missed).
    """
    limit = max(1, min(query.limit, MAX_PAGE))
    before = decode_cursor(query.cursor) if query.cursor else None
    states = list(dict.fromkeys(s.value for s in query.state))  # once each: a state is a walk of its own
    values: dict[str, Any] = {
        "name": name_index.like_pattern(query.name) if query.name else None,
        "owner": query.owner,
        "since": query.updated_since,
        "before": before,
        "limit": limit + 1,
    }
    shape = (len(states), *(values[key] is not None for key in _FILTERS))
    given = {key: value for key, value in values.items() if value is not None}
    given.update({f"state{index}": state for index, state in enumerate(states)})
    if query.name and dialect == "sqlite":
        given["candidates"] = name_index.candidates(query.name)
    if query.name and dialect == "postgresql":
        rows = yield from _postgres_name_rows(shape, given, before, limit + 1)
    else:
        rows = yield _page_statement(dialect, shape), given
    entries = [(job_id, stamp) for job_id, stamp in rows[:limit] if job_id is not None]
    next_cursor = encode_cursor(entries[-1][0]) if len(rows) > limit else None
    return PageIndex(entries, next_cursor)


_FILTERS = ("name", "owner", "since", "before")  # after the states' count, in a page's shape
NEAR_IDS = 500  # PostgreSQL: a name page tests this many newest ids one by one first
RECENT_IDS = 5_000  # and, when they hold some matches, looks through this many before the index
_NEWEST = select(func.max(col(Job.id)))


def _postgres_name_rows(
    shape: tuple[int, ...], given: dict[str, Any], before: int | None, wanted: int
) -> Generator[PageRead, PageRows, PageRows]:
    """A name page on PostgreSQL, in up to three parts below the cursor, each read only when the
    ones before it left the page short:

    1. "near": the NEAR_IDS newest ids, each row tested (the primary key walked back): a common
       substring fills its page here;
    2. "recent": when the near ids held a match (a substring in 1 job of 500, say), the ids below
       them down to RECENT_IDS, as the planner picks;
    3. "older": the rest through the trigram index, its matches sorted (few, or old ones).

    Its planner walks the primary key back for a substring its statistics call common, which reads
    every newer job when the matches are all old ones (a name used only last year): hence the
    bounded parts first. A rare substring goes from the near ids to the index: the planner's pick for
    the recent ids read the trigram index too, so a rare name read it twice (bench.scale's rare
    name, PostgreSQL).
    """
    # Below the newest id too: a cursor beyond it (a page read just before jobs were deleted, or
    # bench.scale's) left the windows empty, and every such page sorted all the older matches.
    newest = yield _NEWEST, {}  # type: ignore[misc]  # one column, not a page's two
    top = min(before or MAX_ID, (newest[0][0] or 0) + 1)
    shape = (*shape[:4], True)  # every part bounds the ids from above
    floor = max(1, top - NEAR_IDS)
    rows = list(
        (yield _page_statement("postgresql", shape, "near"), {**given, "before": top, "floor": floor})
    )
    if rows and len(rows) < wanted and floor > 1:
        upper, floor = floor, max(1, top - RECENT_IDS)
        recent = yield (
            _page_statement("postgresql", shape, "recent"),
            {**given, "before": upper, "floor": floor},
        )
        rows.extend(recent)
    if len(rows) < wanted and floor > 1:
        rows.extend((yield _page_statement("postgresql", shape, "older"), {**given, "before": floor}))
    return rows[:wanted]


@functools.cache
def _page_statement(dialect: str, shape: tuple[int, ...], part: str = "all") -> Select[int | None, datetime]:
    """The statement for one combination of filters (`shape`: how many states, then whether each
    other filter is given), its values bound at execution: built once, since building it cost more
    than the query itself. `part`: see _postgres_name_rows.

    A name is found through service.ledger.name_index. On SQLite its FTS5 table leads, in its own
    rowid (= job id) order, so a page of a common substring ends after its first rows instead of
    sorting every match; PostgreSQL's planner picks between its trigram index and the id order.
    Without a name, states are walks of their own index (_state_page).
    """
    states, name, owner, since, before = shape
    if states and not name:
        return _state_page(dialect, states, owner, since, before)
    statement = select(col(Job.id), col(Job.updated_at))
    walked: ColumnElement[int] = JOB_TABLE.c.id  # the ids the page walks down
    if name:
        statement = statement.where(name_index.name_like(dialect, by_index=part != "near"))
        if dialect == "sqlite":
            fts_id = name_index.fts.c.rowid
            statement = statement.select_from(name_index.fts).join(Job, col(Job.id) == fts_id)
            statement = statement.where(name_index.sqlite_match())
            walked = fts_id  # FTS5 walks (and bounds) its own rowids, not the join's other side
    if states:
        named: list[BindParameter[str]] = [bindparam(f"state{index}") for index in range(states)]
        statement = statement.where(col(Job.state).in_(named))
    statement = _owner_since_before(statement, owner, since, before, walked)
    if part in ("near", "recent"):  # ids from `floor` up: the primary key walked back, bounded
        statement = statement.where(walked >= bindparam("floor"))
    elif part == "older":  # no index gives `id + 0` its order: the trigram index finds, a sort orders
        return statement.order_by((walked + 0).desc()).limit(bindparam("limit"))
    return statement.order_by(walked.desc()).limit(bindparam("limit"))


def _owner_since_before(
    statement: Select[int | None, datetime], owner: int, since: int, before: int, walked: ColumnElement[int]
) -> Select[int | None, datetime]:
    if owner:
        statement = statement.where(col(Job.owner) == bindparam("owner"))
    if since:
        statement = statement.where(col(Job.updated_at) >= bindparam("since", type_=UTCDateTime))
    if before:
        statement = statement.where(walked < bindparam("before"))
    return statement


def _state_page(
    dialect: str, count: int, owner: int, since: int, before: int
) -> Select[int | None, datetime]:
    """A page of `count` states (values state0, state1, ...): each state's newest jobs walked down
    the (state, id) index ((owner, state, id) for one owner's), and with several states the newest
    of their walks (`state IN (...)` read and sorted every match of the states, on both databases).

    Each walk is ordered as its index is, by (state, id), so that no planner walks the id index
    instead. PostgreSQL did for a state nearly every job holds, and filtered its way back past every
    newer (running) job to find a page, where the state's index leads straight to it (bench.scale's
    ?state=succeeded, 10^6 jobs). An equality on the state makes PostgreSQL drop it from the order
    (it is one value), so there the state is bounded by a range and the cursor by a row comparison,
    which its index walks just the same.
    """
    job_state, job_id = col(Job.state), col(Job.id)

    def walk(index: int) -> Select[int | None, datetime]:
        state: BindParameter[str] = bindparam(f"state{index}")
        cursor: BindParameter[int] = bindparam("before")
        if dialect == "postgresql":
            above = tuple_(job_state, job_id) < tuple_(state, cursor) if before else job_state <= state
            bounds = [job_state >= state, above]
        else:
            bounds = [job_state == state, *([job_id < cursor] if before else [])]
        statement = select(job_id, col(Job.updated_at)).where(*bounds)
        statement = _owner_since_before(statement, owner, since, 0, JOB_TABLE.c.id)
        return statement.order_by(job_state.desc(), job_id.desc()).limit(bindparam("limit"))

    if count == 1:
        return walk(0)
    walks = [walk(index).subquery() for index in range(count)]
    newest = union_all(*(select(w.c.id, w.c.updated_at) for w in walks)).subquery()
    return select(newest.c.id, newest.c.updated_at).order_by(newest.c.id.desc()).limit(bindparam("limit"))


def count_by_state_and_backend(session: Session) -> dict[tuple[str, str], int]:
    """How many jobs per (state, backend): one GROUP BY over the (state, backend) index."""
    query = select(Job.state, Job.backend, func.count()).group_by(col(Job.state), col(Job.backend))
    rows = session.exec(query).all()
    return {(JobState(state).value, backend): int(count) for state, backend, count in rows}


def require_backend(backends: Mapping[str, Backend], name: str) -> Backend:
    backend = backends.get(name)
    if backend is None:
        raise InvalidRequest(f"backend '{name}' is not available on this service", field="backend")
    return backend
