"""The Parquet encodings of a capture segment (replay/store/segment.py, issue 26): the 64-bit
integer and timestamp columns are DELTA_BINARY_PACKED, and the rows read back the same,
extreme values (int64 and uint64 bounds, which wrap in the deltas) and nulls included, with
pyarrow and with DuckDB. Spark reads real captures in tests/cli/test_capture_contract.py."""

from __future__ import annotations

import random

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store.schema import capture_schema
from dcptool.replay.store.segment import ParquetSegment

EXTREMES = {"int64": [-2**63, 2**63 - 1, 0, -1, 1], "uint64": [0, 1, 2**63 - 1, 2**63, 2**64 - 1]}


def _rows(schema: pa.Schema, n: int) -> pa.RecordBatch:
    rng = random.Random(26)
    cols = {}
    for f in schema:
        if f.name == "frame_no":
            cols[f.name] = pa.array(range(n), f.type)
        elif str(f.type) in EXTREMES:
            vals = [rng.choice(EXTREMES[str(f.type)] + [None]) for _ in range(n)]
            cols[f.name] = pa.array(vals, f.type)
        elif pa.types.is_timestamp(f.type):
            cols[f.name] = pa.array([rng.choice([0, 2**62, None, 1_700_000_000_000_000_000]) for _ in range(n)],
                                    pa.int64()).cast(f.type)
        elif f.name == "raw":
            cols[f.name] = pa.array([b"\x80\x57" + rng.randbytes(20) for _ in range(n)], f.type)
        else:
            cols[f.name] = pa.nulls(n, f.type)
    return pa.RecordBatch.from_pydict(cols, schema=schema)


def test_64_bit_columns_are_delta_packed_and_read_back_exactly(tmp_path):
    schema = capture_schema("dcp")
    rows = _rows(schema, 1000)
    path = str(tmp_path / "seg.parquet")
    seg = ParquetSegment(path, schema, "zstd")
    seg.add(rows)
    seg.finish()

    md = pq.ParquetFile(path).metadata
    rg = md.row_group(0)
    encodings = {rg.column(i).path_in_schema: rg.column(i).encodings for i in range(md.num_columns)}
    wide = [f.name for f in schema if str(f.type) in EXTREMES or pa.types.is_timestamp(f.type)]
    assert {"frame_no", "cas", "by_seqno", "ts", "mono_ns"} <= set(wide)
    for name in wide:
        assert "DELTA_BINARY_PACKED" in encodings[name], (name, encodings[name])
    assert "DELTA_BINARY_PACKED" not in encodings["vbucket"]     # dictionary columns stay as they were

    back = pq.read_table(path)
    for name in wide + ["raw"]:
        assert back.column(name).to_pylist() == rows.column(name).to_pylist(), name
    ints = [n for n in wide if not pa.types.is_timestamp(schema.field(n).type)]
    got = duckdb.sql(f"select {', '.join(ints)} from read_parquet('{path}') order by frame_no").fetchall()
    assert [list(r) for r in got] == [list(r) for r in zip(*(rows.column(n).to_pylist() for n in ints))]
