"""Writing decoded rows to stdout: JSON lines for pipes, a table for people, or compact
text. Rows are plain dicts. Also the one place for what every command's output shares
(the output contract of docs/CLI.md): the timestamp format (`iso_ns`), terminal-safe
text from the other side (`printable`); DCP keys as text / values as JSON
(`dcp_display`) are replay/display.py's, the pipe writer live/stdout_pipe.py's."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Iterable

import orjson

from dcptool.cli.view.console import stdout_is_tty
from dcptool.live.stdout_pipe import private_pipe_fd, write_pipe
from dcptool.live.table import TextTable, cell_text, terminal_width
from dcptool.protocol.text import printable
from dcptool.replay.display import JSONL_OPTS, dcp_display, json_default, jsonl_bytes
from dcptool.replay.timestamps import iso_ns

if TYPE_CHECKING:
    from dcptool.live.table import TextTable

FORMATS = ("table", "jsonl", "text")

__all__ = ["iso_ns", "printable", "dcp_display", "Sink", "FORMATS"]   # iso_ns: replay/timestamps.py, printable: protocol/text.py


def markup_safe(text) -> str:
    """Server text (names, reasons, filters) for a rich markup line: control characters and markup escaped."""
    from rich.markup import escape
    return escape(printable(text))


def default_format(requested: str | None) -> str:
    if requested:
        return requested
    return "table" if stdout_is_tty() else "jsonl"


def text_line(row: dict) -> str:
    """`--format text`: `name=value` for every column with a value, escaped."""
    return " ".join(f"{k}={printable(cell_text(v))}" for k, v in row.items() if v is not None) + "\n"


class Sink:
    """Writes rows in one of FORMATS; `columns` fixes the table/text column order.

    Tables are written batch by batch (live/table.py): each write_many() prints its
    rows at once; single write()s are gathered up to 50 rows or the next flush().

    JSON lines and text into a pipe go through a non-blocking descriptor of the sink's own
    (write_pipe): a reader that stops reading holds the run up, but a stop signal or the end
    of --duration still ends it."""

    def __init__(self, fmt: str, columns: list[str] | None = None, out=None, title: str | None = None, *,
                 live: bool = False, optional: frozenset[str] = frozenset(), first_widths: dict | None = None):
        self.fmt = fmt
        self.live = live            # a live view: the table's layout only grows (TextTable sticky)
        self.optional = optional    # table columns shown where they cost no line (`ts`)
        self.first_widths = first_widths   # table columns' least widths (what a handshake grows)
        self.columns = columns
        self.out = out if out is not None else sys.stdout
        self._bin = getattr(self.out, "buffer", None)
        self._fd = None
        if fmt in ("jsonl", "text"):
            self._fd = private_pipe_fd(self.out)
            if self._fd is not None:
                self.out.flush()   # what was printed before the rows comes first
        self._table_rows: list[dict] = []
        self._table: TextTable | None = None
        self.title = title
        self.count = 0

    def _emit(self, data) -> None:
        if self._fd is not None:
            write_pipe(self._fd, data)
        elif self._bin is not None:
            self._bin.write(data)
        else:
            self.out.write(bytes(data).decode("utf-8"))

    def write(self, row: dict) -> None:
        self.count += 1
        if self.fmt == "jsonl":
            self._emit(jsonl_bytes(row))
        elif self.fmt == "text":
            if self._fd is not None:
                self._emit(text_line(row).encode("utf-8", "replace"))
            else:
                self.out.write(text_line(row))
        else:
            self._table_rows.append(row)
            if len(self._table_rows) >= 50:
                self._print_table()

    def write_jsonl(self, data: bytes, count: int) -> None:
        """`count` rows already encoded as JSON lines (a fast path of the jsonl format)."""
        self.count += count
        self._emit(data)

    def write_many(self, rows: Iterable[dict]) -> None:
        if self.fmt == "jsonl":
            # append each line at once: a kept orjson result pins a page-sized buffer
            data = bytearray()
            dumps, default = orjson.dumps, json_default
            for r in rows:
                data += dumps(r, default=default, option=JSONL_OPTS)
                self.count += 1
            self._emit(data)
            return
        if self.fmt == "text":
            if self._fd is not None:   # one write for the batch, not one per row
                lines = [text_line(r) for r in rows]
                self.count += len(lines)
                self._emit("".join(lines).encode("utf-8", "replace"))
                return
            for r in rows:
                self.write(r)
            return
        before = len(self._table_rows)
        self._table_rows.extend(rows)
        self.count += len(self._table_rows) - before
        self._print_table()

    def flush(self) -> None:
        if self.fmt == "table":
            self._print_table()
        try:
            self.out.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        try:
            self.flush()
        finally:
            if self._fd is not None:
                import os
                fd, self._fd = self._fd, None
                os.close(fd)

    def _print_table(self) -> None:
        if not self._table_rows:
            return
        if self._table is None:
            self._table = TextTable(self.out, self.columns, self.title, width=terminal_width(self.out),
                                    sticky=self.live, optional=self.optional, first_widths=self.first_widths)
        rows, self._table_rows = self._table_rows, []
        self._table.write(rows)
