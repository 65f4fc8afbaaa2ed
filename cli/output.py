"""Writing decoded rows to stdout: JSON lines for pipes (bytes as base64, keys as in
CAPTURE_FORMAT.md), a rich table for people, or compact text. Rows are plain dicts."""

from __future__ import annotations

import base64
import contextlib
import gc
import sys
from typing import Iterable

import orjson

FORMATS = ("table", "jsonl", "text")


@contextlib.contextmanager
def bulk_rows():
    """The cyclic garbage collector off while rows are made in bulk: rows hold no cycles,
    and with tens of thousands alive per batch its passes cost more than the rows."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def default_format(requested: str | None) -> str:
    if requested:
        return requested
    from dcptool.cli.console import stdout_is_tty
    return "table" if stdout_is_tty() else "jsonl"


def _json_default(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


_OPTS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS


def jsonl_bytes(row: dict) -> bytes:
    return orjson.dumps(row, default=_json_default, option=_OPTS)


class Sink:
    """Writes rows in one of FORMATS; `columns` fixes the table/text column order."""

    def __init__(self, fmt: str, columns: list[str] | None = None, out=None, title: str | None = None):
        self.fmt = fmt
        self.columns = columns
        self.out = out if out is not None else sys.stdout
        self._bin = getattr(self.out, "buffer", None)
        self._header_done = False
        self._table_rows: list[dict] = []
        self.title = title
        self.count = 0

    def write(self, row: dict) -> None:
        self.count += 1
        if self.fmt == "jsonl":
            data = jsonl_bytes(row)
            if self._bin is not None:
                self._bin.write(data)
            else:
                self.out.write(data.decode("utf-8"))
        elif self.fmt == "text":
            self.out.write(" ".join(f"{k}={_text(v)}" for k, v in row.items() if v is not None) + "\n")
        else:
            self._table_rows.append(row)
            if len(self._table_rows) >= 50:
                self.flush()

    def write_many(self, rows: Iterable[dict]) -> None:
        if self.fmt == "jsonl":
            # append each line at once: a kept orjson result pins a page-sized buffer
            data = bytearray()
            dumps, default = orjson.dumps, _json_default
            for r in rows:
                data += dumps(r, default=default, option=_OPTS)
                self.count += 1
            if self._bin is not None:
                self._bin.write(data)
            else:
                self.out.write(data.decode("utf-8"))
            return
        for r in rows:
            self.write(r)

    def flush(self) -> None:
        if self.fmt == "table" and self._table_rows:
            self._print_table(self._table_rows)
            self._table_rows = []
        try:
            self.out.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        self.flush()

    def _print_table(self, rows: list[dict]) -> None:
        from rich.table import Table

        from dcptool.cli.console import data_console
        cols = self.columns or _union_keys(rows)
        cols = [c for c in cols if any(r.get(c) is not None for r in rows)]
        table = Table(show_header=not self._header_done, title=None if self._header_done else self.title,
                      box=None, pad_edge=False)
        for c in cols:
            table.add_column(c, overflow="fold")
        for r in rows:
            table.add_row(*[_text(r.get(c)) for c in cols])
        self._header_done = True
        data_console(self.out, soft_wrap=False, width=None if self._is_tty() else 200).print(table)

    def _is_tty(self) -> bool:
        try:
            return self.out.isatty()
        except (AttributeError, ValueError):
            return False


def _union_keys(rows: list[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


def _text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, (bytes, bytearray, memoryview)):
        b = bytes(v)
        try:
            s = b.decode("utf-8")
            if s.isprintable():
                return s if len(s) <= 60 else s[:57] + "..."
        except UnicodeDecodeError:
            pass
        return "0x" + (b.hex() if len(b) <= 30 else b[:28].hex() + "...")
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_text(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_text(x)}" for k, x in v.items()) + "}"
    return str(v)
