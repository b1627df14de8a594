"""A Core statement run on the driver's own cursor: what the polls' first reads go through
(service.api.reader; service.api.async_postgres on PostgreSQL)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.sql import Select

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
        self._convert = [
            column.type.dialect_impl(dialect).result_processor(dialect, None)
            for column in statement.selected_columns
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
        """A driver's row as SQLAlchemy would have returned it."""
        converted = zip(self._convert, row, strict=True)
        return tuple(value if convert is None else convert(value) for convert, value in converted)
