"""What the two engines' `--sql` share (replay/local/sql.py for DuckDB, replay/spark/sql.py for
Spark): the error classes. A neutral module, so that neither engine imports the other.

A query the read-only check refuses, or one the engine cannot parse or analyse, is a usage
error (exit 2: the *Usage* / *Refused* classes are LateUsageError); a query that fails while
it runs is a runtime error (exit 1: SqlError itself). cli/exit_codes.py maps them."""

from __future__ import annotations

from dcptool.protocol.errors import DcptoolError, LateUsageError


class SqlError(DcptoolError):
    """A query the engine could not parse, analyse or run: one line with the error class, the
    message and the position in the query."""

    def __init__(self, message: str, error_class: str | None = None):
        super().__init__(message)
        self.error_class = error_class


class UnsafeSqlError(SqlError):
    """A query the read-only fence refused (a write, a command, a file or JVM access)."""


class SqlUsageError(SqlError, LateUsageError):
    """A query the engine cannot parse or analyse (exit 2)."""


class RefusedSqlError(UnsafeSqlError, LateUsageError):
    """A query the read-only check refused (exit 2)."""
