"""A Core statement run on the driver's own cursor: what the polls' first reads go through
(service.api.reader; service.api.async_postgres on PostgreSQL), at half the CPU of SQLAlchemy's
execution of the same statement."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Select
from sqlalchemy.types import TypeEngine

from service.ledger.models.columns import UTCDateTime

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing's from Python 3.11


class DriverRead:
    """A Core statement compiled once for the engine's driver, run on the driver's cursor: the same
    SQL and the same values (each value's and each column's conversion is the one SQLAlchemy would
    apply), less the statement machinery. A driver error comes out as SQLAlchemy's (DBAPIError: an
    OperationalError is a database that is down, as everywhere else)."""

    def __init__(self, statement: Select[Unpack[tuple[Any, ...]]], dialect: Dialect) -> None:
        compiled = statement.compile(dialect=dialect)
        self.sql = compiled.string
        self._defaults = dict(compiled.params)  # literals in the statement (`id == 1`)
        self._positions = compiled.positiontup  # a positional driver's (SQLite's `?`) order; else None
        self._bind = {
            name: process
            for name, bind in compiled.binds.items()
            if (process := bind.type.dialect_impl(dialect).bind_processor(dialect)) is not None
        }
        self._convert = [  # (column index, conversion): the columns that have one
            (index, convert)
            for index, column in enumerate(statement.selected_columns)
            if (convert := _converter(column.type, dialect)) is not None
        ]
        self._error: type[Exception] = dialect.loaded_dbapi.Error

    def first(self, connection: Connection, **values: Any) -> tuple[Any, ...] | None:
        """The first row, converted; the driver's transaction is ended (the next read sees new commits)."""
        rows = self._execute(connection, values, lambda cursor: [cursor.fetchone()])
        return None if rows[0] is None else self.converted(rows[0])

    def all(self, connection: Connection, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Every row, converted; the driver's transaction is ended, as by `first`."""
        return [
            self.converted(row)
            for row in self._execute(connection, values, lambda cursor: cursor.fetchall())
        ]

    def parameters(self, values: dict[str, Any]) -> Sequence[Any] | dict[str, Any]:
        """`values` (and the statement's own literals) as the driver takes them."""
        named = {**self._defaults, **values}
        for name, process in self._bind.items():
            if named.get(name) is not None:
                named[name] = process(named[name])
        return [named[name] for name in self._positions] if self._positions else named

    def _execute(
        self, connection: Connection, values: dict[str, Any], fetch: Callable[[Any], list[Any]]
    ) -> list[Any]:
        parameters = self.parameters(values)
        driver = connection.connection.driver_connection
        assert driver is not None
        try:
            cursor = driver.cursor()
            try:
                cursor.execute(self.sql, parameters)
                return fetch(cursor)
            finally:
                cursor.close()
                driver.rollback()
        except self._error as error:
            raise self.error(parameters, error) from error

    def error(self, parameters: Any, error: Exception) -> Exception:
        """A driver's error as SQLAlchemy's (an OperationalError is a database that is down)."""
        return DBAPIError.instance(self.sql, parameters, error, self._error)

    def converted(self, row: Sequence[Any]) -> tuple[Any, ...]:
        """A driver's row as SQLAlchemy would have returned it. Only the columns that have a
        conversion are looked at, not every column of every row."""
        values = list(row)
        for index, convert in self._convert:
            values[index] = convert(values[index])
        return tuple(values)


TIMES_KEPT = 8192  # distinct times kept converted, for every read of one engine together


def _converter(column_type: TypeEngine[Any], dialect: Dialect) -> Callable[[Any], Any] | None:
    if isinstance(column_type, UTCDateTime):
        return _utc_times(dialect)
    return column_type.dialect_impl(dialect).result_processor(dialect, None)


@functools.cache
def _utc_times(dialect: Dialect) -> Callable[[Any], Any] | None:
    """SQLAlchemy's conversion of a UTCDateTime column, one result kept per distinct value.

    SQLite hands times back as text, and turning one into an aware datetime cost a list page an
    eighth of its read (its 51 (id, updated_at) rows).
    Polls read the same stamps again and again (a job's stamp is the one of the commit that last
    changed it, which every job of that commit shares), and a datetime never changes, so each
    distinct text is converted once while it is among the TIMES_KEPT most recently read.
    """
    process = UTCDateTime().dialect_impl(dialect).result_processor(dialect, None)
    return None if process is None else functools.lru_cache(maxsize=TIMES_KEPT)(process)
