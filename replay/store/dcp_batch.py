"""DCP frames -> Arrow record batches in the capture schema, built from the columns of
protocol/dcp/wire/columnar.py: numeric columns from numpy without copies where possible, the
`raw` column zero-copy over the receive buffer, `op` as a dictionary over all 256 opcode
names (the opcode byte is the index)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dcptool.protocol.dcp.wire import columnar
from dcptool.protocol.dcp.wire.constants import OP_NAME_TABLE, op_index
from dcptool.replay.store.schema import (
    DCP_FIELDS,
    DICT_STR,
    FAILOVER_ENTRY,
    capture_schema,
)

SCHEMA = capture_schema("dcp")
_OP_DICT = pa.array(OP_NAME_TABLE, pa.string())
_DIRECTIONS = pa.array(["in", "out"], pa.string())
_TS = pa.timestamp("ns", tz="UTC")
_TYPES = dict(DCP_FIELDS)
# the numpy dtype whose buffer is the Arrow array's as it is, per numeric column
_NUMPY = {name: np.dtype(typ.to_pandas_dtype()) for name, typ in DCP_FIELDS
          if pa.types.is_integer(typ) or pa.types.is_floating(typ)}


def _binary(buf, starts: np.ndarray, lengths: np.ndarray, valid: np.ndarray | None) -> pa.Array:
    n = len(starts)
    lengths = np.where(valid, lengths, 0) if valid is not None else lengths
    offs = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offs[1:])
    total = int(offs[-1])
    if n and (valid is None or valid.all()) and np.array_equal(starts[1:], starts[:-1] + lengths[:-1]):
        # contiguous slices (the raw frames): no copy, offsets over the buffer itself
        base = int(starts[0])
        data = pa.py_buffer(buf)[base:base + total]
    elif total:
        u8 = np.frombuffer(buf, dtype=np.uint8)
        kept = starts if valid is None else starts[valid]
        width = int(lengths.max())
        if len(kept) * width == total:
            # every value the same length (keys usually are): whole rows of a window view
            data = pa.py_buffer(columnar.records(u8, kept, np.dtype(f"V{width}")).view(np.uint8))
        else:
            idx = np.repeat(starts - offs[:-1], lengths) + np.arange(total)
            data = pa.py_buffer(u8[idx])
    else:
        data = pa.py_buffer(b"")
    if total < 2**31:
        offsets = pa.py_buffer(offs.astype(np.int32))
        typ = pa.binary()
    else:
        offsets = pa.py_buffer(offs)
        typ = pa.large_binary()
    validity = None if valid is None or valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
    arr = pa.Array.from_buffers(typ, n, [validity, offsets, data])
    return arr if typ == pa.binary() else arr.cast(pa.binary())


def _int64(values: np.ndarray, typ: pa.DataType) -> pa.Array:
    """A column of int64 values (or nanoseconds for a timestamp) without nulls: over the
    numpy buffer itself when it is one, as pa.array would build it otherwise."""
    values = np.ascontiguousarray(values, dtype=np.int64)
    return pa.Array.from_buffers(typ, len(values), [None, pa.py_buffer(values)], null_count=0)


# All-null columns (most of a batch of data frames: 25-30 of the 45) as slices of one null
# array per type, built once: pa.nulls zeroes new buffers on every receive (20-80 us a column
# at 25k rows).
NULL_ROWS = 1 << 16
_null_columns: dict = {}


def nulls(n: int, typ: pa.DataType) -> pa.Array:
    """n nulls of typ: a zero-copy slice of a cached array (larger n: built)."""
    if n > NULL_ROWS:
        return pa.nulls(n, typ)
    col = _null_columns.get(typ)
    if col is None:
        col = _null_columns[typ] = pa.nulls(NULL_ROWS, typ)
    return col.slice(0, n)


def _numeric(name, col, n):
    typ = _TYPES[name]
    if col is None:
        return nulls(n, typ)
    values, valid = col
    if values.dtype == _NUMPY.get(name) and values.flags.c_contiguous:
        # the column as it is (no copy): what pa.array would build, without its per-call
        # type inspection (issue 26: 30-odd columns on every receive)
        missing = n - int(np.count_nonzero(valid))
        if missing == n:
            return nulls(n, typ)
        validity = pa.py_buffer(np.packbits(valid, bitorder="little")) if missing else None
        return pa.Array.from_buffers(typ, n, [validity, pa.py_buffer(values)], null_count=missing)
    return pa.array(values, typ, mask=~valid) if not valid.all() else pa.array(values, typ)


def to_record_batch(batch: columnar.Batch, *, frame_no: np.ndarray, conn: int | np.ndarray,
                    ts_ns: np.ndarray, mono_ns: np.ndarray, direction: np.ndarray,
                    node: str | None = None) -> pa.RecordBatch:
    """direction: uint8 array, 0 = in, 1 = out; node: the "host:port" the connection went to
    (null when unknown). capture_id is left to the writer."""
    n = batch.n
    assert batch.key is not None and batch.raw is not None, "a batch decode_batch made"
    cols = {
        "frame_no": _int64(frame_no, pa.int64()),
        "conn": pa.array(np.broadcast_to(np.asarray(conn, dtype=np.int32), (n,)), pa.int32()),
        "node": node_column(node, n),
        "ts": _int64(ts_ns, _TS),
        "mono_ns": _int64(mono_ns, pa.int64()),
        "direction": pa.DictionaryArray.from_arrays(pa.array(direction.astype(np.int32), pa.int32()), _DIRECTIONS),
        "raw": _binary(batch.buf, batch.raw[0], batch.raw[1], None),
        "decode_error": pa.array(batch.objects["decode_error"] or [None] * n, pa.string())
        if batch.objects["decode_error"] else nulls(n, pa.string()),
    }
    opcode = batch.numeric["opcode"][0] if n else np.zeros(0, np.uint8)
    for name, _typ in DCP_FIELDS:
        if name == "op":
            magic = batch.numeric["magic"][0] if n else np.zeros(0, np.uint8)
            cols[name] = pa.DictionaryArray.from_arrays(pa.array(op_index(magic, opcode), pa.int32()), _OP_DICT)
        elif name == "key":
            s, ln, v = batch.key
            cols[name] = _binary(batch.buf, s, ln, v)
        elif name == "snap_version":
            vals = batch.objects["snap_version"]
            cols[name] = pa.array(vals, pa.string()).dictionary_encode() if vals else \
                nulls(n, pa.dictionary(pa.int32(), pa.string()))
        elif name == "failover_log":
            vals = batch.objects["failover_log"]
            cols[name] = pa.array(vals, pa.list_(FAILOVER_ENTRY)) if vals else nulls(n, pa.list_(FAILOVER_ENTRY))
        else:
            cols[name] = _numeric(name, batch.numeric.get(name), n)
    arrays = [cols[f.name] if f.name in cols else nulls(n, f.type) for f in SCHEMA]
    arrays = [a if a.type == f.type else a.cast(f.type) for a, f in zip(arrays, SCHEMA)]
    return pa.RecordBatch.from_arrays(arrays, schema=SCHEMA)


def node_column(node: str | None, n: int) -> pa.Array:
    """The `node` column of n rows from one connection: one dictionary value, or nulls."""
    if node is None:
        return nulls(n, DICT_STR)
    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([node], pa.string()))


def frames_to_record_batch(buf, *, collections=False, opaque_vbuckets=None, frame_no_start=0,
                           conn=0, ts_ns=0, mono_ns=0, direction=0, max_body=None, node=None):
    """Convenience for tests and `decode`: every whole frame in buf as one record batch
    (all with the same timestamp and direction). Returns (batch, consumed, error)."""
    kw = {} if max_body is None else {"max_body": max_body}
    offsets, lengths, consumed, err = columnar.scan(buf, **kw)
    b = columnar.decode_batch(buf, offsets, lengths, collections=collections, opaque_vbuckets=opaque_vbuckets)
    n = len(offsets)
    rb = to_record_batch(b, frame_no=np.arange(frame_no_start, frame_no_start + n, dtype=np.int64), conn=conn,
                         ts_ns=np.full(n, ts_ns, dtype=np.int64), mono_ns=np.full(n, mono_ns, dtype=np.int64),
                         direction=np.full(n, direction, dtype=np.uint8), node=node)
    return rb, consumed, err
