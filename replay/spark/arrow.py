"""The Arrow side of the Spark engine (replay/spark/engine.py), without pyspark: the types between
Arrow-as-captured and Arrow-as-Spark-sees-it, and the functions that run in the Python
workers of `applyInArrow` groups (the rules of dcp_rules / synapse_rules on one group of
frames, their result tables packed into one wide output: `vbuckets` and `snapshots` for DCP,
whose other tables are SQL).

Spark has no unsigned types and no nanosecond timestamps: inside Spark, uint8/16/32 are
widened to the next signed type, uint64 becomes decimal(20,0), and timestamps are bigint
nanoseconds since the epoch."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

import dcptool.replay.apply as apply
from dcptool.replay.rules import columns
from dcptool.replay.rules import dcp_vbuckets as dcp_rules
from dcptool.replay.rules import synapse_tables as synapse_rules
from dcptool.replay.rules import tables as T
from dcptool.replay.store.files import arrow_source
from dcptool.replay.store.schema import capture_schema

# the tables of the per-vbucket rules (DcpState: no document; the rest is plans.py's SQL)
DCP_RESULTS = ["vbuckets", "snapshots"]
SYN_RESULTS = ["positions", "rows", "gaps"]


def spark_arrow_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_dictionary(t):
        return spark_arrow_type(t.value_type)
    if t == pa.uint8():
        return pa.int16()
    if t == pa.uint16():
        return pa.int32()
    if t == pa.uint32():
        return pa.int64()
    if t == pa.uint64():
        return pa.decimal128(20, 0)
    if pa.types.is_timestamp(t):
        return pa.int64()
    if pa.types.is_list(t):
        return pa.list_(spark_arrow_type(t.value_type))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(f.name, spark_arrow_type(f.type)) for f in t])
    return t


def spark_arrow_schema(schema: pa.Schema) -> pa.Schema:
    return pa.schema([pa.field(f.name, spark_arrow_type(f.type)) for f in schema])


def to_spark_arrow(table: pa.Table) -> pa.Table:
    return table.cast(spark_arrow_schema(table.schema))


def from_spark_arrow(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Columns of `table` named in `schema`, cast back to its types."""
    cols = [table.column(f.name).cast(f.type) if table.column(f.name).type != f.type else table.column(f.name)
            for f in schema]
    return pa.Table.from_arrays(cols, schema=schema)


def dense_seq(t: pa.Table) -> pa.Table:
    """Replace _seq (rank << 44 | frame_no) by its rank in the group, which fits the local
    engine's 44 bits whatever the frame numbers are."""
    seq = columns.as_numpy(t.column("_seq"), dtype=np.int64)
    order = np.argsort(seq, kind="stable")
    t = t.take(order)
    return t.set_column(t.column_names.index("_seq"), "_seq", pa.array(np.arange(t.num_rows, dtype=np.int64)))


# --- packing several result tables into one grouped output ------------------------------

def packed_schema(protocol: str, names: list[str]) -> pa.Schema:
    fields = [pa.field("_t", pa.int32())]
    for name in names:
        for f in T.schema_of(protocol, name):
            fields.append(pa.field(f"{name}__{f.name}", spark_arrow_type(f.type)))
    return pa.schema(fields)


def pack(protocol: str, names: list[str], results: dict[str, pa.Table]) -> pa.Table:
    schema = packed_schema(protocol, names)
    parts = []
    for i, name in enumerate(names):
        t = to_spark_arrow(results[name])
        n = t.num_rows
        cols = []
        for f in schema:
            if f.name == "_t":
                cols.append(pa.array(np.full(n, i, np.int32)))
            elif f.name.startswith(name + "__"):
                cols.append(t.column(f.name[len(name) + 2:]))
            else:
                cols.append(pa.nulls(n, f.type))
        parts.append(pa.Table.from_arrays(cols, schema=schema))
    return pa.concat_tables(parts)


def _state_schema(protocol: str, cols: list[str], extra: list[str]) -> pa.Schema:
    cap = capture_schema(protocol)
    return pa.schema([cap.field(c) for c in cols] + [pa.field(c, pa.int64()) for c in extra])


def dcp_group(table: pa.Table) -> pa.Table:
    """One `applyInArrow` group of DCP frames (several vbuckets) -> the packed DCP_RESULTS."""
    t = from_spark_arrow(table, _state_schema("dcp", dcp_rules.DCP_STATE_COLUMNS, ["_seq"]))
    return pack("dcp", DCP_RESULTS, dcp_rules.dcp_group_tables(dense_seq(t)))


def synapse_group(max_conn: int, table: pa.Table) -> pa.Table:
    """One (stream, instance) group of Synapse lines -> the packed SYN_RESULTS."""
    t = from_spark_arrow(table, _state_schema("synapse", synapse_rules.SYN_STATE_COLUMNS, ["_seq", "_conn"]))
    return pack("synapse", SYN_RESULTS, synapse_rules.synapse_tables(dense_seq(t), max_conn))


def ops_present(files: list) -> set[str] | None:
    """The op names the captures may hold, from the dictionaries of their Parquet `op`
    column (a superset: a dictionary may name an op no row has), or None when unknown (an
    in-progress segment). Lets a plan leave out a join whose side can only be empty."""
    ops: set[str] = set()
    try:
        for f in files:
            if f.in_progress:
                return None
            pf = pq.ParquetFile(arrow_source(f.path), read_dictionary=["op"])
            for i in range(pf.num_row_groups):
                for chunk in pf.read_row_group(i, columns=["op"]).column(0).chunks:
                    ops.update(x for x in chunk.dictionary.to_pylist() if x is not None)
    except (OSError, KeyError, AttributeError, pa.ArrowException):
        return None
    return ops


def apply_group_table(protocol: str, fn, key, table: pa.Table) -> pa.Table:
    """One `--apply` group in a Python worker: the frames in capture order to the user's
    `fn(key, table)`, its result as one Arrow IPC blob (with the key)."""
    schema = capture_schema(protocol)
    t = from_spark_arrow(table, pa.schema(list(schema) + [pa.field("_seq", pa.int64())]))
    t = t.take(np.argsort(columns.as_numpy(t.column("_seq"), dtype=np.int64), kind="stable")).drop_columns(["_seq"])
    k = tuple(x.as_py() for x in key)
    k = k[0] if protocol == "dcp" else k
    result = apply.call_user(fn, k, t)   # prints to stderr; errors as one line with their type
    sink = io.BytesIO()
    if result is not None:
        with pa.ipc.new_stream(sink, result.schema) as w:
            w.write_table(result)
    keys = {"vbucket": [k]} if protocol == "dcp" else {"stream": [k[0]], "instance": [k[1]]}
    types = {"vbucket": pa.int32(), "stream": pa.string(), "instance": pa.string()}
    cols = {c: pa.array(v, types[c]) for c, v in keys.items()}
    cols["ipc"] = pa.array([sink.getvalue() if result is not None else None], pa.binary())
    return pa.table(cols)
