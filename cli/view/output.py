"""Writing decoded rows to stdout: JSON lines for pipes, a table for people, or compact
text. Rows are plain dicts. Also the one place for what every command's output shares
(the output contract of docs/CLI.md): the timestamp format (`iso_ns`), terminal-safe
text from the other side (`printable`), and DCP keys as text / values as JSON
(`dcp_display`)."""

from __future__ import annotations

import base64
import contextlib
import gc
import sys
from typing import Iterable

import orjson

FORMATS = ("table", "jsonl", "text")

from dcptool.protocol.errors import DcptoolError
from dcptool.protocol.text import printable
from dcptool.replay.timestamps import iso_ns

__all__ = ["iso_ns", "printable", "dcp_display", "Sink", "FORMATS"]   # iso_ns: replay/timestamps.py, printable: protocol/text.py


def markup_safe(text) -> str:
    """Server text (names, reasons, filters) for a rich markup line: control characters and markup escaped."""
    from rich.markup import escape
    return escape(printable(text))


# ------------------------------------------------------------------ keys and values

DATATYPE_JSON, DATATYPE_SNAPPY, DATATYPE_XATTR = 0x01, 0x02, 0x04
MAX_SNAPPY_OUT = 20 * 1024 * 1024  # the largest Couchbase item: a bigger claim is hostile


def _b64(b) -> str:
    return base64.b64encode(b).decode("ascii")


def key_fields(key) -> tuple[str | None, str | None]:
    """(key, key_base64): the UTF-8 text and None, or None and the bytes as base64."""
    if key is None:
        return None, None
    if type(key) is str:
        return key, None
    b = bytes(key)
    try:
        return b.decode("utf-8"), None
    except UnicodeDecodeError:
        return None, _b64(b)


def snappy_decompress(b: bytes) -> bytes:
    """Raw (unframed) Snappy, as Couchbase sends it; ValueError when it is not."""
    from dcptool.protocol.dcp.wire import snappy
    return snappy.decompress(b, MAX_SNAPPY_OUT)


def value_fields(value, datatype: int | None) -> tuple[object, str | None, str | None]:
    """(value, value_base64, value_error) for display. A value of JSON datatype (after
    Snappy decompression when the Snappy bit is set) that parses is the JSON value itself;
    anything else is base64 (decompressed when it could be). A value that does not
    decompress keeps its bytes as sent, with value_error saying why."""
    if value is None:
        return None, None, None
    b = bytes(value)
    dt = datatype or 0
    if dt & DATATYPE_SNAPPY:
        try:
            b = snappy_decompress(b)
        except ValueError as exc:
            return None, _b64(b), f"snappy: {exc}"
    if dt & DATATYPE_JSON and not dt & DATATYPE_XATTR:
        try:
            return orjson.loads(b), None, None
        except orjson.JSONDecodeError as exc:
            return None, _b64(b), f"not valid JSON: {str(exc).splitlines()[0]}"
    return None, _b64(b), None


# snapshot marker flags by name (DCP_DIGEST §5.3), lowest bit first
SNAP_FLAG_NAMES = ((0x01, "memory"), (0x02, "disk"), (0x04, "checkpoint"), (0x08, "ack"), (0x10, "history"),
                   (0x20, "may_duplicates"))
_FLAG_NAME_CACHE: dict = {}
OSO_FLAG_NAMES = {0x01: "oso_start", 0x02: "oso_end"}   # an oso_snapshot row's snap_flags


def snap_flag_names(flags: int | None) -> str | None:
    """Snapshot marker flags as `disk|checkpoint|history|may_duplicates` (unknown bits as hex)."""
    if flags is None:
        return None
    name = _FLAG_NAME_CACHE.get(flags)
    if name is None:
        parts = [n for bit, n in SNAP_FLAG_NAMES if flags & bit]
        rest = flags & ~0x3F
        if rest:
            parts.append(f"0x{rest:x}")
        name = _FLAG_NAME_CACHE.setdefault(flags, "|".join(parts))
    return name


def dcp_display(row: dict) -> dict:
    """A DCP row (from messages.to_row or the codecs) made ready for output, in place: `key`
    as text with `key_base64` for a key that is not UTF-8; with a `value` column,
    `value` / `value_base64` / `value_error` as value_fields says; an empty `snap_flag_names`
    column gets the marker flags by name (cli/view/dcp_rows.py)."""
    if "key" in row:
        k = row["key"]
        if k is None or type(k) is str:
            row.setdefault("key_base64", None)
        else:
            row["key"], row["key_base64"] = key_fields(k)
    if "value" in row:
        v = row["value"]
        if isinstance(v, (bytes, bytearray, memoryview)):
            row["value"], row["value_base64"], row["value_error"] = value_fields(v, row.get("datatype"))
        else:  # no value, or made ready already
            row.setdefault("value_base64", None)
            row.setdefault("value_error", None)
    if "snap_flag_names" in row and row["snap_flag_names"] is None and row.get("snap_flags") is not None:
        f = row["snap_flags"]
        row["snap_flag_names"] = OSO_FLAG_NAMES.get(f) if row.get("op") == "oso_snapshot" else snap_flag_names(f)
    return row


VALUE_COLUMNS = ["value", "value_base64", "value_error"]


def display_columns(columns: list[str], values: bool = False) -> list[str]:
    """A DCP table's columns with key_base64 after key and, with --values, the value
    columns after value_len (or at the end)."""
    cols = with_key_base64(columns)
    if values:
        at = cols.index("value_len") + 1 if "value_len" in cols else len(cols)
        cols[at:at] = [c for c in VALUE_COLUMNS if c not in cols]
    return cols


def with_key_base64(columns: list[str]) -> list[str]:
    """`columns` with key_base64 right after key (table column lists)."""
    out = []
    for c in columns:
        out.append(c)
        if c == "key" and "key_base64" not in columns:
            out.append("key_base64")
    return out


# ------------------------------------------------------------------ sinks

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
    from dcptool.cli.view.console import stdout_is_tty
    return "table" if stdout_is_tty() else "jsonl"


def json_default(obj):
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if hasattr(obj, "isoformat"):
        return obj.isoformat()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


_OPTS = orjson.OPT_APPEND_NEWLINE | orjson.OPT_NON_STR_KEYS


def jsonl_bytes(row: dict) -> bytes:
    return orjson.dumps(row, default=json_default, option=_OPTS)


def text_line(row: dict) -> str:
    """`--format text`: `name=value` for every column with a value, escaped."""
    from dcptool.cli.view.table import cell_text
    return " ".join(f"{k}={printable(cell_text(v))}" for k, v in row.items() if v is not None) + "\n"


# ------------------------------------------------------------------ stdout that may not drain

OUTPUT_GRACE = 1.0   # seconds output may stay blocked once the run is asked to stop


class _StopState:
    """What the stdout writer of a run (Sink) knows about its end: a stop signal (noted by the
    handlers of note_stop_signals, at the moment it came) and the --duration deadline. A
    write the reader does not take is abandoned OUTPUT_GRACE seconds after either."""

    def __init__(self):
        self.signum: int | None = None
        self.signal_at: float | None = None
        self.deadline: float | None = None

    def limit(self) -> float | None:
        times = [t for t in (self.signal_at, self.deadline) if t is not None]
        return min(times) + OUTPUT_GRACE if times else None


STOP = _StopState()


def run_deadline(seconds: float | None) -> None:
    """A run starts; it ends `seconds` from now (--duration, None: no limit): a write blocked
    past that is abandoned."""
    import time
    STOP.signum = STOP.signal_at = None
    STOP.deadline = time.monotonic() + seconds if seconds else None


def note_signal(signum: int) -> None:
    import time
    if STOP.signum is None:
        STOP.signum, STOP.signal_at = int(signum), time.monotonic()


def note_stop_signals() -> None:
    """Have the current Python-level handlers of SIGINT, SIGTERM and SIGHUP also note the
    signal for the stdout writer (call it after asyncio's add_signal_handler: its handler only
    wakes the event loop, which cannot run while a write waits for the reader)."""
    import signal
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        old = signal.getsignal(sig)
        if getattr(old, "_notes_stop", False):
            continue

        def handler(signum, frame, old=old):
            note_signal(signum)
            if callable(old):
                old(signum, frame)
        handler._notes_stop = True
        try:
            signal.signal(sig, handler)
        except (ValueError, OSError):   # not the main thread
            return


class OutputStalled(DcptoolError):
    """The run ended (--duration) but stdout's reader took nothing for OUTPUT_GRACE seconds."""


def _private_pipe_fd(out) -> int | None:
    """A non-blocking descriptor of our own on the pipe `out` writes to (opened anew through
    /proc, so the O_NONBLOCK flag is not shared with the other processes of the pipe), or
    None when `out` is no pipe (files never block; a terminal is a person)."""
    import os
    import stat
    try:
        fd = out.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return None
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except (OSError, ValueError, AttributeError):
        return None


def _write_pipe(fd: int, data) -> None:
    """All of `data` to non-blocking `fd`, waiting for the reader as long as it takes, except
    after a stop (STOP): then Interrupted (a signal) or OutputStalled (--duration) once the
    reader took nothing for OUTPUT_GRACE seconds. EPIPE raises BrokenPipeError (`| head`)."""
    import os
    import select
    import time
    mv = memoryview(data).cast("B")
    poller = None
    while mv:
        try:
            n = os.write(fd, mv)
            mv = mv[n:]
            continue
        except BlockingIOError:
            pass
        if poller is None:
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
        limit = STOP.limit()
        now = time.monotonic()
        if limit is not None and now >= limit:
            if STOP.signum is not None:
                from dcptool.cli.errors import Interrupted
                raise Interrupted(STOP.signum)
            raise OutputStalled(f"nobody read standard output for {OUTPUT_GRACE:.0f}s after the end of the run; "
                                f"{len(mv)} bytes and the rows after them not written")
        poller.poll(100 if limit is None else max(1, min(100, int((limit - now) * 1000) + 1)))


class Sink:
    """Writes rows in one of FORMATS; `columns` fixes the table/text column order.

    Tables are written batch by batch (cli/view/table.py): each write_many() prints its
    rows at once; single write()s are gathered up to 50 rows or the next flush().

    JSON lines and text into a pipe go through a non-blocking descriptor of the sink's own
    (_write_pipe): a reader that stops reading holds the run up, but a stop signal or the end
    of --duration still ends it."""

    def __init__(self, fmt: str, columns: list[str] | None = None, out=None, title: str | None = None):
        self.fmt = fmt
        self.columns = columns
        self.out = out if out is not None else sys.stdout
        self._bin = getattr(self.out, "buffer", None)
        self._fd = None
        if fmt in ("jsonl", "text"):
            self._fd = _private_pipe_fd(self.out)
            if self._fd is not None:
                self.out.flush()   # what was printed before the rows comes first
        self._table_rows: list[dict] = []
        self._table = None
        self.title = title
        self.count = 0

    def _emit(self, data) -> None:
        if self._fd is not None:
            _write_pipe(self._fd, data)
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
                data += dumps(r, default=default, option=_OPTS)
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
            from dcptool.cli.view.table import TextTable, terminal_width
            self._table = TextTable(self.out, self.columns, self.title, width=terminal_width(self.out))
        rows, self._table_rows = self._table_rows, []
        self._table.write(rows)
