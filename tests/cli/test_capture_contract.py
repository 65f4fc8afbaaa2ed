"""Captures as other tools see them: every column's name and type against CAPTURE_FORMAT.md
(replay/store/schema.py), read back with pyarrow (validate(full=True)), pandas, DuckDB when
installed, and Spark. Every column carries a value somewhere, extremes included."""

from __future__ import annotations

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay.store import schema as S
from dcptool.replay.store.writer import CaptureWriter

U64_MAX = 2**64 - 1
T0 = 1_700_000_000_123_456_789


def _dcp_rows() -> list[dict]:
    fl = [{"vbucket_uuid": U64_MAX, "seqno": 5}, {"vbucket_uuid": 1, "seqno": 0}]
    rows = [
        dict(direction="out", magic=0x80, opcode=0x1F, op="hello", opaque=1, cas=0, datatype=0,
             raw=b"\x80\x1f" + b"\x00" * 22, key=b"dcptool"),
        dict(direction="out", magic=0x80, opcode=0x53, op="stream_req", vbucket=3, opaque=2,
             req_flags=0, req_start_seqno=0, req_end_seqno=U64_MAX, req_vbucket_uuid=2**63 + 5,
             req_snap_start=0, req_snap_end=0, raw=b"\x80\x53" + b"\x00" * 70),
        dict(magic=0x81, opcode=0x53, op="stream_req", status=0, vbucket=3, opaque=2,
             failover_log=fl, raw=b"\x81\x53" + b"\x00" * 54),
        dict(magic=0x80, opcode=0x56, op="snapshot_marker", vbucket=3, opaque=2, snap_version="2.2",
             snap_start=0, snap_end=9, snap_flags=0x21, max_visible_seqno=9,
             high_completed_seqno=8, purge_seqno=0, high_prepared_seqno=7, raw=b"\x80\x56"),
        dict(magic=0x08, opcode=0x57, op="mutation", vbucket=3, opaque=2, cas=U64_MAX - 1,
             datatype=0x07, stream_id=65535, collection_id=2**32 - 1, key=b"doc-\x00\xff",
             value_len=2**32 - 1, by_seqno=2**63 - 1, rev_seqno=1, item_flags=2**32 - 1,
             expiration=2**32 - 1, lock_time=0, raw=b"\x08\x57" + bytes(range(256))),
        dict(magic=0x80, opcode=0x58, op="deletion", vbucket=65535, by_seqno=2, rev_seqno=2,
             delete_time=1_700_000_000, value_len=0, key=b"gone", raw=b"\x80\x58"),
        dict(magic=0x80, opcode=0x5F, op="system_event", vbucket=3, by_seqno=3, system_event_id=1,
             raw=b"\x80\x5f"),
        dict(magic=0x80, opcode=0x55, op="stream_end", vbucket=3, stream_end_reason=4, raw=b"\x80\x55"),
        dict(magic=0x81, opcode=0x53, op="stream_req", status=0x23, vbucket=4, rollback_seqno=12,
             raw=b"\x81\x53"),
        dict(magic=0x80, opcode=0xEE, op="unknown_0xee", decode_error="unknown opcode 0xee",
             raw=b"\x80\xee\x00"),
    ]
    return rows


def _synapse_rows() -> list[dict]:
    return [
        dict(command="SERVER", args="hs1", raw=b"SERVER hs1"),
        dict(direction="out", command="NAME", args="dcptool", raw=b"NAME dcptool"),
        dict(command="POSITION", stream="events", instance="master", prev_token=1, new_token=2,
             raw=b"POSITION events master 1 2"),
        dict(command="RDATA", stream="events", instance="master", batch=True, row='["a"]',
             raw=b'RDATA events master batch ["a"]'),
        dict(command="RDATA", stream="events", instance="master", token=2**62, batch=False,
             row='["b"]', raw=b'RDATA events master 4611686018427387904 ["b"]',
             channel="hs1"),
        dict(command="BOGUS", decode_error="unknown command", raw=b"BOGUS \xff"),
    ]


def write_capture(directory, protocol: str) -> tuple[list[str], list[dict], CaptureWriter]:
    rows = _dcp_rows() if protocol == "dcp" else _synapse_rows()
    types = dict(S.fields(protocol))
    for i, r in enumerate(rows):
        r.setdefault("direction", "in")
        r.update(frame_no=i, conn=i // 4, node=f"127.0.0.1:{11210 + i // 4}", ts=T0 + i, mono_ns=10**12 + i)
    half = len(rows) // 2
    w = CaptureWriter(directory, protocol, source=f"{protocol}://127.0.0.1/x",
                      options={"vbuckets": [3, 4], "password": "never"}, rotate_size=1)
    for part in (rows[:half], rows[half:]):           # two segments
        names = sorted({k for r in part for k in r})
        w.write(pa.Table.from_pylist(part, schema=pa.schema([(k, types[k]) for k in names])))
    segs = w.close()
    return [s["path"] for s in segs], rows, w


def test_every_column_is_set_somewhere():
    for protocol, rows in (("dcp", _dcp_rows()), ("synapse", _synapse_rows())):
        given = {k for r in rows for k in r} | {"capture_id", "frame_no", "conn", "node", "ts", "mono_ns", "direction"}
        assert given == set(S.column_names(protocol)), protocol


@pytest.mark.parametrize("protocol", ["dcp", "synapse"])
def test_pyarrow_reads_it_exactly_as_the_contract_says(tmp_path, protocol):
    paths, rows, w = write_capture(tmp_path, protocol)
    assert len(paths) == 2
    contract = S.capture_schema(protocol)
    got_rows = []
    for seg, path in enumerate(paths):
        pf = pq.ParquetFile(path)
        assert [(f.name, f.type) for f in pf.schema_arrow] == [(f.name, f.type) for f in contract]
        meta = {k.decode(): v.decode() for k, v in pf.metadata.metadata.items()}
        assert {k: meta[k] for k in S.META_KEYS} == {
            "dcptool.format": "2", "dcptool.protocol": protocol, "dcptool.capture_id": w.capture_id,
            "dcptool.segment": str(seg), "dcptool.started_at": w.started_at,
            "dcptool.version": S.tool_version(), "dcptool.source": f"{protocol}://127.0.0.1/x",
            "dcptool.options": json.dumps({"vbuckets": [3, 4]}, separators=(",", ":"))}
        # the Parquet-level types, for readers that ignore the stored Arrow schema
        leaves = {pf.schema.column(j).path: pf.schema.column(j) for j in range(len(pf.schema))}
        ts = leaves["ts"]
        assert ts.physical_type == "INT64"
        assert "isAdjustedToUTC=true" in str(ts.logical_type) and "nanoseconds" in str(ts.logical_type)
        unsigned = {f.name: f.type for f in pf.schema_arrow if pa.types.is_unsigned_integer(f.type)}
        if protocol == "dcp":
            unsigned["failover_log.list.element.vbucket_uuid"] = pa.uint64()
        for name, typ in unsigned.items():
            lt = str(leaves[name].logical_type)
            assert f"bitWidth={typ.bit_width}" in lt and "isSigned=false" in lt, (name, lt)
        table = pq.read_table(path)
        table.validate(full=True)
        assert table.schema.equals(contract, check_metadata=False)
        ns = table.column("ts").cast(pa.int64()).to_pylist()
        got_rows.extend(dict(r, ts=t) for r, t in zip(table.drop_columns(["ts"]).to_pylist(), ns))
    assert [r["frame_no"] for r in got_rows] == list(range(len(rows)))
    for want, got in zip(rows, got_rows):
        assert got["capture_id"] == w.capture_id
        for k, v in want.items():
            assert got[k] == v, (k, got[k], v)


@pytest.mark.parametrize("protocol", ["dcp", "synapse"])
def test_pandas_reads_it(tmp_path, protocol):
    import pandas as pd
    paths, rows, _ = write_capture(tmp_path, protocol)
    # pandas reads the capture directory as one dataset (segments in name = segment order)
    assert all(pathlib.Path(p).parent == tmp_path for p in paths)
    df = pd.read_parquet(tmp_path)
    assert list(df.columns) == S.column_names(protocol)
    assert str(df["ts"].dtype) == "datetime64[ns, UTC]"
    assert df["ts"].iloc[0].value == T0
    assert str(df["capture_id"].dtype) == "category"
    assert df["frame_no"].tolist() == list(range(len(rows)))
    assert df["raw"].iloc[0] == rows[0]["raw"]
    # with Arrow-backed dtypes every column keeps the contract's type
    dfa = pd.read_parquet(paths[0], dtype_backend="pyarrow")
    contract = dict(S.fields(protocol))
    for name in dfa.columns:
        t = dfa[name].dtype.pyarrow_dtype if hasattr(dfa[name].dtype, "pyarrow_dtype") else None
        want = contract[name]
        if pa.types.is_dictionary(want):
            assert t in (want, pa.string(), pa.large_string()) or str(dfa[name].dtype) == "category", name
        else:
            assert t == want, (name, t, want)


def test_duckdb_reads_it(tmp_path):
    import duckdb
    paths, rows, _ = write_capture(tmp_path, "dcp")
    con = duckdb.connect()
    res = con.execute(f"SELECT count(*), max(by_seqno), max(req_end_seqno) FROM read_parquet({paths!r})").fetchone()
    assert res == (len(rows), 2**63 - 1, U64_MAX)


SPARK_TYPES = {
    "int64": "bigint", "int32": "int", "uint8": "smallint", "uint16": "int", "uint32": "bigint",
    "uint64": "decimal(20,0)", "string": "string", "binary": "binary", "bool": "boolean",
    # TIMESTAMP(NANOS) is read as nanoseconds since the epoch
    # (spark.sql.legacy.parquet.nanosAsLong, set by replay/spark/engine.py:make_session)
    "timestamp[ns, tz=UTC]": "bigint",
}


def spark_type(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return spark_type(t.value_type)
    if pa.types.is_list(t):
        return f"array<{spark_type(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ",".join(f"{f.name}:{spark_type(f.type)}" for f in t) + ">"
    return SPARK_TYPES[str(t)]


def check_with_spark(spark, directory, protocol, rows) -> None:
    df = spark.read.parquet(str(directory))
    assert [(f.name, f.dataType.simpleString()) for f in df.schema.fields] == \
        [(name, spark_type(t)) for name, t in S.fields(protocol)]
    got = [r.asDict(recursive=True) for r in df.orderBy("frame_no").collect()]
    assert [g["frame_no"] for g in got] == list(range(len(rows)))
    assert got[0]["ts"] == T0
    for want, g in zip(rows, got):
        for k, v in want.items():
            if k in ("ts",):
                continue
            if isinstance(v, list):   # failover log
                assert [(int(e["vbucket_uuid"]), e["seqno"]) for e in g[k]] == \
                    [(e["vbucket_uuid"], e["seqno"]) for e in v]
            elif isinstance(v, bytes):
                assert bytes(g[k]) == v
            else:
                assert g[k] == v, (k, g[k], v)


@pytest.fixture
def spark_session(request):
    try:
        import dcptool.replay.spark.engine  # noqa: F401
    except ImportError:
        pytest.skip("replay/spark/engine.py (make_session) is not there yet")
    return request.getfixturevalue("spark")


@pytest.mark.spark
@pytest.mark.parametrize("protocol", ["dcp", "synapse"])
def test_spark_reads_it(tmp_path, spark_session, protocol):
    paths, rows, _ = write_capture(tmp_path, protocol)
    check_with_spark(spark_session, tmp_path, protocol, rows)
