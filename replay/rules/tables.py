"""The result tables of REPLAY.md: their Arrow schemas, keys (the canonical sort), and the
checksum both engines are compared with.

Canonical form of a table: cast to the schema below, rows sorted ascending by the table's
key columns (nulls first; binary keys bytewise), one chunk.

Checksum: SHA-256 over UTF-8 JSON lines. The first line is
`{"table":NAME,"columns":[COLUMN,...]}`; then one line per row in canonical order, an object
whose keys are the columns in schema order, written without spaces (`{"a":1,"b":null}`)
and each line ends with `\\n`. Values: null as `null`; booleans `true`/`false`; integers in
decimal; strings as JSON strings (only `"`, `\\\\` and control characters escaped, everything
else as UTF-8); binary as standard base64 with padding; timestamps as integer nanoseconds
since the Unix epoch (UTC); lists as arrays; structs as objects with keys in field order.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from dcptool.replay.store.schema import DICT_STR, fields

TS = pa.timestamp("ns", tz="UTC")
STR = pa.string()
I64 = pa.int64()
# the body columns of `documents` and `history` (replay/rules/bodies.py): the value as the
# application stored it, its xattrs as JSON object text, the value as text when JSON
BODY = (("value", pa.binary()), ("xattrs", STR), ("value_json", STR))


def _s(*cols) -> pa.Schema:
    return pa.schema([pa.field(n, t) for n, t in cols])


DCP_TABLES: dict[str, tuple[pa.Schema, tuple[str, ...]]] = {
    "documents": (_s(("vbucket", pa.uint16()), ("collection_id", pa.uint32()), ("key", pa.binary()),
                     ("by_seqno", I64), ("rev_seqno", I64), ("cas", pa.uint64()), ("state", STR),
                     ("datatype", pa.uint8()), ("item_flags", pa.uint32()), ("expiration", pa.uint32()),
                     ("value_len", pa.uint32()), ("capture_id", STR), ("frame_no", I64), ("ts", TS), *BODY),
                  ("vbucket", "collection_id", "key")),
    "vbuckets": (_s(("vbucket", pa.uint16()), ("vbucket_uuid", pa.uint64()), ("high_seqno", I64),
                    ("live", I64), ("deleted", I64), ("expired", I64), ("mutations", I64),
                    ("deletions", I64), ("expirations", I64), ("snapshots", I64), ("rollbacks", I64),
                    ("last_snapshot_complete", pa.bool_()), ("stream_end_reason", pa.uint32()),
                    ("first_ts", TS), ("last_ts", TS)),
                 ("vbucket",)),
    "snapshots": (_s(("vbucket", pa.uint16()), ("capture_id", STR), ("frame_no", I64), ("ts", TS),
                     ("snap_version", STR), ("snap_start", I64), ("snap_end", I64),
                     ("snap_flags", pa.uint32()), ("items", I64), ("first_seqno", I64),
                     ("last_seqno", I64), ("complete", pa.bool_())),
                  ("vbucket", "capture_id", "frame_no")),
    "rollbacks": (_s(("vbucket", pa.uint16()), ("capture_id", STR), ("frame_no", I64), ("ts", TS),
                     ("rollback_seqno", I64), ("undone", I64)),
                  ("vbucket", "capture_id", "frame_no")),
    "failover": (_s(("vbucket", pa.uint16()), ("position", pa.int32()), ("vbucket_uuid", pa.uint64()),
                    ("seqno", I64)),
                 ("vbucket", "position")),
    # one row per document change a rollback undid: the rollback (capture_id, frame_no, ts,
    # rollback_seqno), the change (collection_id, key, by_seqno, op, change_*), and whether
    # the document's current change came after the rollback (restored, restored_seqno)
    "undone": (_s(("vbucket", pa.uint16()), ("capture_id", STR), ("frame_no", I64), ("ts", TS),
                  ("rollback_seqno", I64), ("collection_id", pa.uint32()), ("key", pa.binary()),
                  ("by_seqno", I64), ("op", STR), ("change_capture_id", STR), ("change_frame_no", I64),
                  ("change_ts", TS), ("restored", pa.bool_()), ("restored_seqno", I64)),
               ("vbucket", "capture_id", "frame_no", "collection_id", "key", "by_seqno",
                "change_capture_id", "change_frame_no")),
    # change history (replay/rules/history.py): one row per document change not undone by a
    # rollback, every version (a change received twice is one row, the last received);
    # snap_flags: the flags of the snapshot marker it arrived under
    "history": (_s(("vbucket", pa.uint16()), ("collection_id", pa.uint32()), ("key", pa.binary()),
                   ("by_seqno", I64), ("op", STR), ("state", STR), ("rev_seqno", I64), ("cas", pa.uint64()),
                   ("datatype", pa.uint8()), ("item_flags", pa.uint32()), ("expiration", pa.uint32()),
                   ("value_len", pa.uint32()), ("snap_flags", pa.uint32()), ("capture_id", STR),
                   ("frame_no", I64), ("ts", TS), *BODY),
                ("vbucket", "collection_id", "key", "by_seqno")),
    # one row per (cluster config revision, vbucket), the revision where it was first seen
    # (replay/rules/topology.py): who sent it (node, via) and the vbucket's active node and replicas
    "topology": (_s(("rev_epoch", I64), ("rev", I64), ("capture_id", STR), ("frame_no", I64), ("ts", TS),
                    ("node", STR), ("via", STR), ("vbucket", pa.uint16()), ("active", STR),
                    ("replicas", pa.list_(STR))),
                 ("rev_epoch", "rev", "vbucket")),
    # one row per lag poll (GET_ALL_VB_SEQNOS, --lag-interval) and vbucket streamed
    # (replay/rules/lag.py): the high seqno the node answered, the seqno received by then
    "lag": (_s(("ts", TS), ("node", STR), ("vbucket", pa.uint16()), ("high_seqno", I64), ("seqno", I64),
               ("lag_items", I64), ("capture_id", STR), ("frame_no", I64)),
            ("ts", "capture_id", "frame_no", "vbucket")),
}

SYNAPSE_TABLES: dict[str, tuple[pa.Schema, tuple[str, ...]]] = {
    "positions": (_s(("stream", STR), ("instance", STR), ("token", I64), ("rows", I64),
                     ("batches", I64), ("gaps", I64), ("dropped", I64), ("pending", I64),
                     ("first_ts", TS), ("last_ts", TS)),
                  ("stream", "instance")),
    "rows": (_s(("stream", STR), ("instance", STR), ("token", I64), ("index", I64), ("row", STR),
                ("capture_id", STR), ("frame_no", I64), ("ts", TS)),
             ("stream", "instance", "token", "index")),
    "gaps": (_s(("stream", STR), ("instance", STR), ("capture_id", STR), ("frame_no", I64), ("ts", TS),
                ("from_token", I64), ("to_token", I64)),
             ("stream", "instance", "capture_id", "frame_no")),
    "commands": (_s(("command", STR), ("count", I64), ("first_ts", TS), ("last_ts", TS)),
                 ("command",)),
    # one row per POSITION received, against the last RDATA token of its stream and instance
    # (replay/rules/lag.py)
    "lag": (_s(("ts", TS), ("node", STR), ("stream", STR), ("instance", STR), ("position", I64),
               ("rdata_token", I64), ("lag_tokens", I64), ("capture_id", STR), ("frame_no", I64)),
            ("ts", "capture_id", "frame_no")),
}

FRAMES_KEY = ("capture_id", "frame_no")


def frames_schema(protocol: str) -> pa.Schema:
    """The capture columns with dictionary strings as plain strings."""
    return pa.schema([pa.field(n, STR if t == DICT_STR else t) for n, t in fields(protocol)])


def table_specs(protocol: str) -> dict[str, tuple[pa.Schema, tuple[str, ...]]]:
    base = DCP_TABLES if protocol == "dcp" else SYNAPSE_TABLES if protocol == "synapse" else None
    if base is None:
        raise ValueError(f"unknown protocol {protocol!r}")
    return {**base, "frames": (frames_schema(protocol), FRAMES_KEY)}


def table_names(protocol: str) -> list[str]:
    return list(table_specs(protocol))


def schema_of(protocol: str, name: str) -> pa.Schema:
    return table_specs(protocol)[name][0]


def canonical(protocol: str, name: str, table: pa.Table, presorted: bool = False) -> pa.Table:
    """`table` cast to the schema of `name` and sorted by its key (nulls first); `presorted`:
    the caller built it in that order already (replay/rules/history.py), so no sort."""
    schema, keys = table_specs(protocol)[name]
    t = pa.Table.from_arrays(_conformed(schema, table), schema=schema)
    if t.num_rows > 1 and not presorted:
        t = t.take(_sort_indices(t, keys))
    return t.combine_chunks()


def canonical_batch(protocol: str, name: str, batch: pa.RecordBatch) -> pa.RecordBatch:
    """One record batch of a table already in canonical order (a part of DuckDB's sorted
    result stream), cast to the schema of `name` as `canonical` casts a whole table."""
    schema = schema_of(protocol, name)
    return pa.RecordBatch.from_arrays(_conformed(schema, batch), schema=schema)


def _conformed(schema: pa.Schema, data) -> list:
    cols = []
    for fld in schema:
        col = data.column(fld.name)
        cols.append(col if col.type == fld.type else col.cast(fld.type))
    return cols


@dataclass
class Batches:
    """A canonical table handed on as record batches in canonical order, to be read once
    (DuckDB's result stream, replay/local/duck.py): written and checksummed batch by batch,
    never whole in memory (replay/results.py write_tables)."""
    schema: pa.Schema
    batches: Iterator[pa.RecordBatch]


def _sort_indices(t: pa.Table, keys) -> pa.Array:
    try:  # pyarrow >= 25: null placement per key
        opts = pc.SortOptions([(k, "ascending", "at_start") for k in keys])
    except (TypeError, ValueError):
        opts = pc.SortOptions([(k, "ascending") for k in keys], null_placement="at_start")
    return pc.sort_indices(t, options=opts)


def _encode_column(col: pa.ChunkedArray | pa.Array) -> list:
    typ = col.type
    if pa.types.is_timestamp(typ):
        return col.cast(pa.int64()).to_pylist()
    if pa.types.is_binary(typ) or pa.types.is_large_binary(typ):
        return [None if v is None else base64.b64encode(v).decode("ascii") for v in col.to_pylist()]
    if pa.types.is_dictionary(typ):
        return col.cast(typ.value_type).to_pylist()
    return col.to_pylist()


def iter_canonical_lines(name: str, table: pa.Table, batch_rows: int = 65536) -> Iterable[bytes]:
    """The lines the checksum hashes, for an already canonical table."""
    yield header_line(name, table.column_names)
    for start in range(0, table.num_rows, batch_rows):
        yield from row_lines(table.slice(start, batch_rows))


def header_line(name: str, columns: list[str]) -> bytes:
    """The checksum's first line."""
    return orjson.dumps({"table": name, "columns": columns}) + b"\n"


def row_lines(part: pa.Table | pa.RecordBatch) -> Iterable[bytes]:
    """The checksum's lines of the rows of `part` (canonical rows, in order)."""
    names = part.column_names
    cols = [_encode_column(part.column(n)) for n in names]
    for values in zip(*cols):
        yield orjson.dumps(dict(zip(names, values))) + b"\n"


def checksum(name: str, table: pa.Table) -> str:
    """SHA-256 (hex) of a canonical table, as documented in the module docstring."""
    digest = Checksum(name, table.schema)
    digest.update(table)
    return digest.hexdigest()


# columns that say where and when a row was recorded, not what the source said
# (REPLAY.md "Content checksums"): left out of the content checksum
PROVENANCE = frozenset({"capture_id", "frame_no", "ts", "first_ts", "last_ts",
                        "change_capture_id", "change_frame_no", "change_ts"})
# and of `frames`: the connection's number, the address it went to, the monotonic clock
FRAMES_PROVENANCE = PROVENANCE | {"conn", "node", "mono_ns"}


def content_columns(name: str, columns: Iterable[str]) -> list[str]:
    """The columns of table `name` the content checksum covers: all but provenance."""
    drop = FRAMES_PROVENANCE if name == "frames" else PROVENANCE
    return [c for c in columns if c not in drop]


class Checksum:
    """`checksum` of a table fed batch by batch in canonical order (Batches): the same digest."""

    def __init__(self, name: str, schema: pa.Schema):
        self.hash = hashlib.sha256(header_line(name, schema.names))

    def update(self, batch: pa.RecordBatch | pa.Table, batch_rows: int = 65536) -> None:
        for start in range(0, batch.num_rows, batch_rows):
            for line in row_lines(batch.slice(start, batch_rows)):
                self.hash.update(line)

    def hexdigest(self) -> str:
        return self.hash.hexdigest()


class ContentChecksum:
    """The content checksum of a table (REPLAY.md "Content checksums"): its rows without the
    provenance columns, as a multiset, so the order of the rows (which the provenance columns
    decide for some tables) does not count. SHA-256 over the header line (the table and its
    content columns), the row count in decimal and a newline, then the 32-byte big-endian sum
    modulo 2**256 of the SHA-256 of each row's line (the row as the checksum writes it).
    Fed batch by batch in any order: the same digest."""

    def __init__(self, name: str, schema: pa.Schema):
        self.name = name
        self.columns = content_columns(name, schema.names)
        self.total = 0
        self.rows = 0

    def update(self, batch: pa.RecordBatch | pa.Table, batch_rows: int = 65536) -> None:
        part = batch.select(self.columns)
        total = self.total
        for start in range(0, part.num_rows, batch_rows):
            for line in row_lines(part.slice(start, batch_rows)):
                total += int.from_bytes(hashlib.sha256(line).digest(), "big")
        self.total = total % (1 << 256)
        self.rows += part.num_rows

    def hexdigest(self) -> str:
        digest = hashlib.sha256(header_line(self.name, self.columns))
        digest.update(b"%d\n" % self.rows)
        digest.update(self.total.to_bytes(32, "big"))
        return digest.hexdigest()


def content_checksum(name: str, table: pa.Table) -> str:
    """`ContentChecksum` of a whole table."""
    digest = ContentChecksum(name, table.schema)
    digest.update(table)
    return digest.hexdigest()
