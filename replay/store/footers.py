"""Parquet footers of finished segments, parsed once per process and file version, so that
every later look at a segment (its metadata, row counts, statistics, the read of its rows)
reuses the parsed footer; parsed on a few threads when there are many (in_threads).

Two readers. `footer(path)` is pyarrow's FileMetaData (what reading the rows needs). The
facts finding and planning a replay need (key-value metadata, row count, null counts:
`key_values`, `num_rows`, `null_state`) come from it when pyarrow is loaded, and otherwise
from a small sans-IO reader of the footer's Thrift compact encoding (`parse_footer`), so that
a replay whose tables DuckDB writes itself never loads pyarrow (0.24 s and 40 MiB at start).
That reader takes ~1.2 ms for a capture segment's ~10 KB footer against pyarrow's ~0.3 ms,
so a capture of many segments (prefetch_footers: 64 or more) loads pyarrow and uses its
reader, as before. Anything the small reader cannot make sense of (hostile or truncated
bytes, an encrypted footer) goes to pyarrow's reader, whose errors stay the ones users see."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, NamedTuple

from dcptool.protocol.errors import DcptoolError
from dcptool.replay.store.files import arrow_source

if TYPE_CHECKING:      # pyarrow is loaded by the functions that need it
    import pyarrow.parquet as pq


_FOOTERS: dict[tuple, "pq.FileMetaData"] = {}     # (path, size, mtime_ns) -> footer
PARSED: list[int] = [0]      # footers parsed by this process (tests count them)


def footer(path: str) -> "pq.FileMetaData":
    """The Parquet footer of a finished segment, read once per version of the file (every
    later look at it, row counts, row groups, statistics, reads, reuses it)."""
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    md = _FOOTERS.get(key)
    if md is None:
        import pyarrow.parquet as pq
        md = _FOOTERS[key] = pq.read_metadata(arrow_source(path))
        PARSED[0] += 1
    return md


def forget() -> None:
    """Drop the parsed footers (tests: the next look at each file parses it again)."""
    _FOOTERS.clear()
    _LIGHT.clear()


def prefetch_footers(paths: list[str]) -> None:
    """Read the footers of many finished segments on a few threads (pyarrow parses them
    without the GIL); errors are left for describe() to report."""
    todo = list(paths)
    if len(todo) < 64:
        return
    import pyarrow as pa

    def one(path: str) -> None:
        try:
            footer(path)
        except (OSError, pa.ArrowException, ValueError):
            pass
    in_threads(one, todo)


THREADS = min(4, (os.cpu_count() or 2) * 2)


def in_threads(fn, items: list) -> list:
    """[fn(x) for x in items], on THREADS threads for a long list: each thread takes one slice
    of the list (a future per item would cost more Python than pyarrow's work on a small
    file). The first error raised is raised here."""
    if len(items) < 64:
        return [fn(x) for x in items]
    import concurrent.futures
    step = -(-len(items) // THREADS)
    with concurrent.futures.ThreadPoolExecutor(max_workers=THREADS) as pool:
        parts = pool.map(lambda i: [fn(x) for x in items[i:i + step]], range(0, len(items), step))
        return [y for part in parts for y in part]


_LEAVES: dict[tuple, dict[str, int]] = {}


def leaf_index(md: "pq.FileMetaData", name: str) -> int | None:
    """The Parquet column index of top-level leaf `name` in a footer, or None. Segments of one
    capture share their layout: the names are listed once per layout, not once per file."""
    n = md.num_columns
    if not n:
        return None
    key = (n, md.schema.column(0).path, md.schema.column(n - 1).path)
    names = _LEAVES.get(key)
    if names is None:
        names = _LEAVES[key] = {md.schema.column(i).path: i for i in range(n)}
    i = names.get(name)
    if i is not None and md.schema.column(i).path != name:    # another layout with that key
        i = next((j for j in range(n) if md.schema.column(j).path == name), None)
    return i


_TOP: dict[tuple, frozenset] = {}


def top_names(md: "pq.FileMetaData") -> frozenset:
    """The top-level column names of a footer's schema (what `schema_arrow.names` lists),
    worked out once per layout: segments of one capture share theirs."""
    key = tuple(md.schema.names)          # the leaves, in order: ~0.02 ms a footer
    names = _TOP.get(key)
    if names is None:
        names = _TOP[key] = frozenset(md.schema.to_arrow_schema().names)
    return names


# ---- the facts of a footer, from either reader

_LIGHT: dict[tuple, "Footer | None"] = {}    # (path, size, mtime_ns) -> footer, None: pyarrow reads it
LIGHT: bool | None = None     # tests: True / False forces the small reader on / off (None: see light)


def light(path: str) -> "Footer | None":
    """The small reader's footer of `path`, or None when pyarrow's reader is the one to use:
    pyarrow is loaded (its reader is faster), or the bytes are not a footer the small reader
    takes (pyarrow then reports what is wrong, as before)."""
    use = ("pyarrow.parquet" not in sys.modules) if LIGHT is None else LIGHT
    try:
        st = os.stat(path)
    except OSError:
        return None
    key = (os.path.abspath(path), st.st_size, st.st_mtime_ns)   # duck.py asks by the absolute path
    if key in _LIGHT:
        return _LIGHT[key]
    if not use or (path, st.st_size, st.st_mtime_ns) in _FOOTERS:
        return None
    try:
        found = read_footer(path)
    except (OSError, FooterError):
        found = None
    _LIGHT[key] = found
    PARSED[0] += 1
    return found


def key_values(path: str) -> dict:
    """The footer's key-value metadata, bytes -> bytes (pyarrow's FileMetaData.metadata)."""
    lt = light(path)
    return lt.metadata if lt is not None else (footer(path).metadata or {})


def num_rows(path: str) -> int:
    lt = light(path)
    return lt.num_rows if lt is not None else footer(path).num_rows


def null_state(path: str, column: str) -> str | None:
    """What the statistics tell of `column` in the file: "absent" (no such column), "null"
    (null in every row), "values" (some row holds one), None (no statistics say)."""
    lt = light(path)
    if lt is not None:
        counts = [(g.num_rows, g.null_counts.get(column, "absent")) for g in lt.row_groups]
        if counts and all(c == "absent" for _, c in counts):
            return "absent"
        if not counts:
            return "null" if not lt.num_rows else None
    else:
        md = footer(path)
        i = leaf_index(md, column)
        if i is None:
            return "absent"
        counts = []
        for r in range(md.num_row_groups):
            st = md.row_group(r).column(i).statistics
            counts.append((md.row_group(r).num_rows, st.null_count if st is not None and st.has_null_count else None))
    if any(not isinstance(c, int) for _, c in counts):
        return None
    return "null" if all(c == rows for rows, c in counts) else "values"


# ---- the small reader: Parquet's FileMetaData in Thrift's compact protocol

MAGIC = b"PAR1"
# a footer larger than this is left to pyarrow (a capture segment's is ~10 KB)
MAX_FOOTER = 16 << 20
MAX_DEPTH = 16

# Thrift compact protocol types
_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(13)


class FooterError(DcptoolError):
    """Bytes the small reader does not take for a Parquet footer (pyarrow then reads the file;
    never shown to a user)."""


class RowGroup(NamedTuple):
    num_rows: int
    null_counts: dict      # leaf path ("a" or "a.b") -> null count, or None without statistics


class Footer(NamedTuple):        # NamedTuples: a dataclass costs milliseconds to build at import
    num_rows: int
    metadata: dict         # key (bytes) -> value (bytes), as pyarrow's FileMetaData.metadata
    row_groups: tuple


def read_footer(path) -> Footer:
    """The footer of the Parquet file at `path` (OSError as open/read raise it)."""
    with open(path, "rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        if size < 12:
            raise FooterError("too short for a Parquet file")
        fh.seek(size - 8)
        tail = fh.read(8)
        if tail[4:] != MAGIC:
            raise FooterError("no Parquet magic at the end")
        length = int.from_bytes(tail[:4], "little")
        if length <= 0 or length > min(MAX_FOOTER, size - 12):
            raise FooterError("footer length out of range")
        fh.seek(size - 8 - length)
        data = fh.read(length)
    if len(data) != length:
        raise FooterError("footer cut short")
    return parse_footer(data)


def parse_footer(data: bytes) -> Footer:
    """FileMetaData from its Thrift compact encoding (FooterError on anything else)."""
    try:
        reader = _Reader(data)
        fields = reader.struct(0, _FILE_META)
    except (IndexError, ValueError, TypeError, RecursionError) as exc:
        raise FooterError(f"not a Parquet footer ({exc})") from None
    if reader.pos > len(data):
        raise FooterError("footer cut short")
    if fields is None:      # (never: only a skipped struct reads as None)
        raise FooterError("not a Parquet footer")
    num_rows = fields.get(3)
    groups = fields.get(4, [])
    kv = fields.get(5, [])
    if not isinstance(num_rows, int) or not isinstance(groups, list) or not isinstance(kv, list):
        raise FooterError("FileMetaData without num_rows or row groups")
    metadata = {}
    for item in kv:
        if not isinstance(item, dict) or not isinstance(item.get(1), bytes):
            raise FooterError("bad key-value metadata")
        value = item.get(2, b"")
        metadata[item[1]] = value if isinstance(value, bytes) else b""
    return Footer(num_rows, metadata, tuple(_row_group(g) for g in groups))


def _row_group(g) -> RowGroup:
    if not isinstance(g, dict) or not isinstance(g.get(3), int) or not isinstance(g.get(1), list):
        raise FooterError("bad row group")
    nulls = {}
    for chunk in g[1]:
        meta = chunk.get(3) if isinstance(chunk, dict) else None
        if not isinstance(meta, dict) or not isinstance(meta.get(3), list):
            raise FooterError("column chunk without metadata")
        path = b".".join(p for p in meta[3] if isinstance(p, bytes)).decode("utf-8", "replace")
        stats = meta.get(12)
        count = stats.get(3) if isinstance(stats, dict) else None
        nulls[path] = count if isinstance(count, int) else None
    return RowGroup(g[3], nulls)


# what parse_footer keeps of FileMetaData, by Thrift field id (a list: its elements' spec;
# None: the value whole); every other field is walked over, nothing built of it
_STATISTICS = {3: None}                                  # null_count
_COLUMN_META = {3: None, 12: _STATISTICS}                # path_in_schema, statistics
_ROW_GROUP = {1: {3: _COLUMN_META}, 3: None}             # columns (ColumnChunk.meta_data), num_rows
_FILE_META = {3: None, 4: _ROW_GROUP, 5: {1: None, 2: None}}   # num_rows, row_groups, key_value_metadata
_SKIP = False


class _Reader:
    """Thrift compact protocol over one buffer, by a spec of what to keep: structs as {field
    id: value}, lists as lists, binary as bytes, integers as int (zigzag undone); what the spec
    leaves out (and maps, doubles) is walked over and checked, not built."""

    def __init__(self, data: bytes):
        self.data = data
        self.pos = 0

    def varint(self) -> int:
        data, pos = self.data, self.pos
        shift = result = 0
        while True:
            b = data[pos]
            pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                break
            shift += 7
            if shift > 63:
                raise ValueError("varint too long")
        self.pos = pos
        return result

    def value(self, kind: int, depth: int, spec=None):
        if kind in (_I16, _I32, _I64):
            n = self.varint()
            return (n >> 1) ^ -(n & 1)
        if kind == _BINARY:
            n = self.varint()
            end = self.pos + n
            if end > len(self.data):
                raise ValueError("binary past the end")
            out = self.data[self.pos:end] if spec is not _SKIP else None
            self.pos = end
            return out
        if kind == _STRUCT:
            return self.struct(depth + 1, spec if isinstance(spec, dict) else _SKIP)
        if kind in (_LIST, _SET):
            return self.list(depth + 1, spec)
        if kind == _BYTE:
            self.pos += 1
            return self.data[self.pos - 1]
        if kind == _DOUBLE:
            self.pos += 8
            if self.pos > len(self.data):
                raise ValueError("double past the end")
            return None
        if kind == _MAP:
            n = self.varint()
            if n:
                types = self.data[self.pos]
                self.pos += 1
                for _ in range(n):
                    self.value(types >> 4, depth + 1, _SKIP)
                    self.value(types & 15, depth + 1, _SKIP)
            return None
        if kind in (_TRUE, _FALSE):      # a boolean in a list: one byte
            self.pos += 1
            return self.data[self.pos - 1] == _TRUE
        raise ValueError(f"unknown type {kind}")

    def list(self, depth: int, spec) -> list | None:
        if depth > MAX_DEPTH:
            raise ValueError("nested too deep")
        head = self.data[self.pos]
        self.pos += 1
        n, kind = head >> 4, head & 15
        if n == 15:
            n = self.varint()
        if n > len(self.data) - self.pos:      # every element takes a byte at least
            raise ValueError("list longer than the footer")
        if spec is _SKIP:
            for _ in range(n):
                self.value(kind, depth, _SKIP)
            return None
        return [self.value(kind, depth, spec) for _ in range(n)]

    def struct(self, depth: int, spec) -> dict | None:
        if depth > MAX_DEPTH:
            raise ValueError("nested too deep")
        out: dict | None = {} if spec is not _SKIP else None
        fid = 0
        data = self.data
        while True:
            head = data[self.pos]
            self.pos += 1
            kind = head & 15
            if kind == _STOP:
                return out
            delta = head >> 4
            if delta:
                fid += delta
            else:
                n = self.varint()
                fid = (n >> 1) ^ -(n & 1)
            if kind == _TRUE or kind == _FALSE:
                if out is not None:
                    out[fid] = kind == _TRUE
            elif out is not None and fid in spec:
                out[fid] = self.value(kind, depth, spec[fid])
            else:
                self.value(kind, depth, _SKIP)
