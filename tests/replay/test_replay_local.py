"""The in-process engine against the row-by-row interpreter of REPLAY.md
(tests/support/oracle.py), on generated captures and on hand-written scenarios."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dcptool.replay import apply
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader
from tests.support import capgen, oracle

SETTINGS = dict(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _replay_dir(tmp_path, protocol, s, n_events, in_progress, truncate, max_captures=3):
    d = tmp_path / f"{protocol}-{s}-{n_events}-{in_progress}-{truncate}"
    caps = capgen.generate(protocol, s, n_events=n_events, max_captures=max_captures)
    capgen.write_captures(caps, str(d), seed=s, in_progress_last=in_progress, truncate_bytes=truncate)
    return reader.find_captures([str(d)])


# 30 examples (each ~0.5 s, nearly all of it the engine's DuckDB set-up): one explicit example
# of each of the 18 combinations of the sampled options (seeded capture and size), then 12 drawn
DCP_OPTIONS = [(p, t, c) for p in (False, True) for t in (0, 7, 200) for c in (3, 64, 1 << 20)]
DCP_EXAMPLES = 12


def _every_dcp_option(test):
    rng = random.Random("dcp-local-oracle")
    for options in DCP_OPTIONS:
        test = example(s=rng.randrange(2**32), n=rng.randrange(251), options=options)(test)
    return test


@settings(**{**SETTINGS, "max_examples": DCP_EXAMPLES})
@given(s=st.integers(0, 2**32 - 1), n=st.integers(0, 250), options=st.sampled_from(DCP_OPTIONS))
@_every_dcp_option
def test_dcp_local_equals_oracle(tmp_path_factory, s, n, options):
    in_progress, truncate, chunk = options
    files = _replay_dir(tmp_path_factory.mktemp("c"), "dcp", s, n, in_progress, truncate)
    want = oracle.dcp(files)
    got = local.replay_local(files, chunk_rows=chunk)
    for name, table in want.items():
        assert got.table(name).equals(table), name


@settings(**SETTINGS)
@given(s=st.integers(0, 2**32 - 1), n=st.integers(0, 250), in_progress=st.booleans(),
       truncate=st.sampled_from([0, 0, 7, 200]))
def test_synapse_local_equals_oracle(tmp_path_factory, s, n, in_progress, truncate):
    files = _replay_dir(tmp_path_factory.mktemp("c"), "synapse", s, n, in_progress, truncate)
    want = oracle.synapse(files)
    got = local.replay_local(files)
    for name, table in want.items():
        assert got.table(name).equals(table), name


def test_generated_captures_exercise_every_rule(tmp_path):
    """The generator really produces rollbacks that undo changes, duplicate keys, gaps..."""
    seen = dict.fromkeys(["undone", "complete", "incomplete", "deleted", "expired", "dropped",
                          "gaps", "batches", "pending", "reconnects"], 0)
    for s in range(12):
        r = local.replay_local(_replay_dir(tmp_path, "dcp", s, 200, False, 0))
        seen["undone"] += sum(r.table("rollbacks").column("undone").to_pylist())
        c = r.table("snapshots").column("complete").to_pylist()
        seen["complete"] += c.count(True)
        seen["incomplete"] += c.count(False)
        seen["deleted"] += sum(r.table("vbuckets").column("deleted").to_pylist())
        seen["expired"] += sum(r.table("vbuckets").column("expired").to_pylist())
        seen["reconnects"] += max(r.table("frames").column("conn").to_pylist())
        p = local.replay_local(_replay_dir(tmp_path, "synapse", s, 200, False, 0)).table("positions")
        for k in ("dropped", "gaps", "batches", "pending"):
            seen[k] += sum(p.column(k).to_pylist())
    assert all(v > 0 for v in seen.values()), seen


# --- hand-written scenarios with values worked out by hand ---------------------------------

def _dcp_files(tmp_path, rows, name="c"):
    meta = {"dcptool.format": "1", "dcptool.protocol": "dcp", "dcptool.capture_id": "c0ffee00-0000-4000-8000-000000000001",
            "dcptool.started_at": "2025-11-22T01:02:03.000000Z", "dcptool.segment": "0"}
    for i, r in enumerate(rows):
        r.setdefault("capture_id", meta["dcptool.capture_id"])
        r.setdefault("frame_no", i)
        r.setdefault("conn", 0)
        r.setdefault("ts", 1_000 + i)
        r.setdefault("direction", "in")
    d = tmp_path / name
    capgen.write_captures([(meta, capgen.to_table("dcp", rows, meta))], str(d), max_segments=1)
    return reader.find_captures([str(d)])


def _mut(vb, key, seqno, op="mutation", **kw):
    return dict(magic=0x80, op=op, vbucket=vb, key=key, by_seqno=seqno, rev_seqno=1, cas=seqno, **kw)


def test_rollback_restores_earlier_version_and_counts_undone(tmp_path):
    files = _dcp_files(tmp_path, [
        dict(magic=0x81, op="stream_req", vbucket=3, status=0, failover_log=[{"vbucket_uuid": 7, "seqno": 0}]),
        dict(magic=0x80, op="snapshot_marker", vbucket=3, snap_start=1, snap_end=4, snap_flags=1),
        _mut(3, b"a", 1), _mut(3, b"b", 2), _mut(3, b"a", 3), _mut(3, b"c", 4, op="deletion"),
        dict(magic=0x81, op="stream_req", vbucket=3, status=0x23, rollback_seqno=2),
        dict(magic=0x81, op="stream_req", vbucket=3, status=0,
             failover_log=[{"vbucket_uuid": 9, "seqno": 2}, {"vbucket_uuid": 7, "seqno": 0}]),
        dict(magic=0x80, op="snapshot_marker", vbucket=3, snap_start=3, snap_end=5, snap_flags=1),
        _mut(3, b"d", 3),
        dict(magic=0x80, op="stream_end", vbucket=3, stream_end_reason=0),
    ])
    r = local.replay_local(files)
    docs = {d["key"]: d for d in r.table("documents").to_pylist()}
    assert sorted(docs) == [b"a", b"b", b"d"]
    assert docs[b"a"]["by_seqno"] == 1 and docs[b"a"]["state"] == "live"  # back to seqno 1
    rb = r.table("rollbacks").to_pylist()
    assert [(x["rollback_seqno"], x["undone"]) for x in rb] == [(2, 2)]
    snaps = r.table("snapshots").to_pylist()
    assert [(s["items"], s["first_seqno"], s["last_seqno"], s["complete"]) for s in snaps] == \
        [(4, 1, 4, True), (1, 3, 3, False)]
    vb = r.table("vbuckets").to_pylist()[0]
    assert (vb["vbucket_uuid"], vb["high_seqno"], vb["live"], vb["mutations"], vb["deletions"],
            vb["rollbacks"], vb["last_snapshot_complete"], vb["stream_end_reason"]) == (9, 3, 3, 4, 1, 1, False, 0)
    assert r.table("failover").to_pylist() == [
        {"vbucket": 3, "position": 0, "vbucket_uuid": 9, "seqno": 2},
        {"vbucket": 3, "position": 1, "vbucket_uuid": 7, "seqno": 0}]


def test_snapshot_complete_by_next_marker_and_duplicate_keys(tmp_path):
    files = _dcp_files(tmp_path, [
        dict(magic=0x80, op="snapshot_marker", vbucket=0, snap_start=1, snap_end=9, snap_flags=0x32),
        _mut(0, b"k", 5), _mut(0, b"k", 4, op="expiration"),  # history: the later frame wins
        dict(magic=0x80, op="snapshot_marker", vbucket=0, snap_start=10, snap_end=12, snap_flags=1),
        _mut(0, b"x", 10),
        dict(magic=0x80, op="seqno_advanced", vbucket=0, by_seqno=12),
    ])
    r = local.replay_local(files)
    assert [(s["complete"], s["items"]) for s in r.table("snapshots").to_pylist()] == [(True, 2), (True, 1)]
    docs = {d["key"]: d["state"] for d in r.table("documents").to_pylist()}
    assert docs == {b"k": "expired", b"x": "live"}
    assert r.table("vbuckets").column("high_seqno").to_pylist() == [12]


def _syn_files(tmp_path, rows):
    meta = {"dcptool.format": "1", "dcptool.protocol": "synapse", "dcptool.capture_id": "5e000000-0000-4000-8000-000000000002",
            "dcptool.started_at": "2025-11-22T01:02:03.000000Z", "dcptool.segment": "0"}
    for i, r in enumerate(rows):
        r.update(capture_id=meta["dcptool.capture_id"], frame_no=i, ts=1_000 + i)
        r.setdefault("conn", 0)
        r.setdefault("direction", "in")
    d = tmp_path / "s"
    capgen.write_captures([(meta, capgen.to_table("synapse", rows, meta))], str(d), max_segments=1)
    return reader.find_captures([str(d)])


def test_synapse_batch_gap_and_reconnect(tmp_path):
    E = dict(stream="events", instance="master")
    files = _syn_files(tmp_path, [
        dict(command="POSITION", prev_token=5, new_token=5, **E),
        dict(command="RDATA", batch=True, row="r1", **E),
        dict(command="RDATA", batch=True, row="r2", **E),
        dict(command="RDATA", token=7, batch=False, row="r3", **E),
        dict(command="POSITION", prev_token=9, new_token=10, **E),       # 8..9 never seen
        dict(command="RDATA", batch=True, row="lost", **E),
        dict(command="PING", args="1", conn=1),                           # reconnect
        dict(command="RDATA", token=11, batch=False, row="r4", conn=1, **E),
        dict(command="RDATA", batch=True, row="waiting", conn=1, **E),
    ])
    r = local.replay_local(files)
    assert [(x["token"], x["index"], x["row"]) for x in r.table("rows").to_pylist()] == \
        [(7, 0, "r1"), (7, 1, "r2"), (7, 2, "r3"), (11, 0, "r4")]
    assert [(g["from_token"], g["to_token"]) for g in r.table("gaps").to_pylist()] == [(7, 9)]
    p = r.table("positions").to_pylist()[0]
    assert (p["token"], p["rows"], p["batches"], p["gaps"], p["dropped"], p["pending"]) == (11, 4, 1, 1, 1, 1)
    assert {c["command"]: c["count"] for c in r.table("commands").to_pylist()} == {"POSITION": 2, "RDATA": 6, "PING": 1}


# --- reader ---------------------------------------------------------------------------

def test_in_progress_truncated_returns_complete_batches(tmp_path):
    caps = capgen.generate("dcp", 5, n_events=100, max_captures=1)
    meta, table = caps[0]
    d = tmp_path / "cap"
    paths = capgen.write_captures(caps, str(d), max_segments=1, in_progress_last=True, truncate_bytes=30)
    assert paths[0].endswith(".arrows")
    files = reader.find_captures([str(d)])
    assert files[0].in_progress and files[0].capture_id == meta["dcptool.capture_id"]
    got = reader.read_capture_table(files)
    batch = max(1, table.num_rows // 3)
    complete = (table.num_rows // batch - (1 if table.num_rows % batch == 0 else 0)) * batch
    assert got.num_rows == complete and complete > 0
    assert got.column("frame_no").to_pylist() == list(range(complete))
    # the parquet of the same segment wins over the in-progress file
    capgen.write_captures(caps, str(d), max_segments=1)
    files = reader.find_captures([str(d)])
    assert not files[0].in_progress and reader.read_capture_table(files).num_rows == table.num_rows
    # and Spark gets Parquet for both kinds
    os.remove(files[0].path)
    files = reader.find_captures([str(d)])
    out = reader.parquet_paths(files, str(tmp_path))
    assert out[0].startswith(str(tmp_path)) and out[0].endswith(".parquet")
    import pyarrow.parquet as pq
    assert pq.read_table(out[0]).num_rows == complete


def test_order_does_not_depend_on_argument_order(tmp_path):
    caps = capgen.generate("synapse", 11, n_events=80, max_captures=3)
    paths = capgen.write_captures(caps, str(tmp_path / "c"), seed=3)
    a = reader.find_captures(paths)
    b = reader.find_captures(list(reversed(paths)))
    assert a == b
    ta, tb = reader.read_capture_table(a), reader.read_capture_table(b)
    assert ta.equals(tb) and ta.num_rows == sum(t.num_rows for _, t in caps)
    ids = [m["dcptool.capture_id"] for m, _ in caps]
    assert list(dict.fromkeys(ta.column("capture_id").to_pylist())) == ids


def test_reader_errors(tmp_path):
    bad = tmp_path / "x.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(reader.CaptureError):
        reader.find_captures([str(bad)])
    import pyarrow.parquet as pq
    plain = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1]}), plain)
    with pytest.raises(reader.CaptureError, match="not a dcptool capture"):
        reader.find_captures([str(plain)])
    with pytest.raises(reader.CaptureError):
        reader.find_captures([str(tmp_path / "missing")])
    d1 = capgen.write_captures(capgen.generate("dcp", 1, 10, 1), str(tmp_path / "d"))
    s1 = capgen.write_captures(capgen.generate("synapse", 1, 10, 1), str(tmp_path / "s"))
    with pytest.raises(reader.CaptureError, match="different protocols"):
        reader.find_captures(d1 + s1)


def test_missing_columns_are_null(tmp_path):
    caps = capgen.generate("dcp", 2, n_events=20, max_captures=1)
    meta, table = caps[0]
    table = table.drop_columns(["system_event_id", "req_snap_end"])
    d = tmp_path / "c"
    d.mkdir()
    import pyarrow.parquet as pq
    pq.write_table(table, d / capgen.file_name(meta, 0))
    got = reader.read_capture_table(reader.find_captures([str(d)]))
    assert got.schema.names == T.frames_schema("dcp").names
    assert got.column("system_event_id").null_count == got.num_rows


# --- checksum -------------------------------------------------------------------------

def test_checksum_is_the_documented_encoding():
    t = T.canonical("synapse", "rows", pa.table({
        "stream": ["b", "a"], "instance": ["m", None], "token": [2, 1], "index": [0, 0],
        "row": ['{"x":"é"}', None], "capture_id": ["c", "c"], "frame_no": [5, 4],
        "ts": pa.array([10, 20], pa.int64()).cast(T.TS)}))
    lines = [json.dumps({"table": "rows", "columns": t.column_names}, separators=(",", ":"), ensure_ascii=False)]
    for r in [("a", None, 1, 0, None, "c", 4, 20), ("b", "m", 2, 0, '{"x":"é"}', "c", 5, 10)]:
        lines.append(json.dumps(dict(zip(t.column_names, r)), separators=(",", ":"), ensure_ascii=False))
    want = hashlib.sha256("".join(x + "\n" for x in lines).encode()).hexdigest()
    assert T.checksum("rows", t) == want
    b = T.canonical("dcp", "failover", pa.table({"vbucket": [1], "position": [0], "vbucket_uuid": pa.array([2**64 - 1], pa.uint64()), "seqno": [3]}))
    line = '{"vbucket":1,"position":0,"vbucket_uuid":18446744073709551615,"seqno":3}\n'
    head = '{"table":"failover","columns":["vbucket","position","vbucket_uuid","seqno"]}\n'
    assert T.checksum("failover", b) == hashlib.sha256((head + line).encode()).hexdigest()
    key = base64.b64encode(b"\x00k").decode()
    assert f'"key":"{key}"' in b"".join(T.iter_canonical_lines("documents", T.canonical("dcp", "documents", pa.table(
        {c: pa.array([b"\x00k" if c == "key" else None], T.schema_of("dcp", "documents").field(c).type)
         for c in T.schema_of("dcp", "documents").names})))).decode()


def test_apply_runs_per_group_in_capture_order(tmp_path):
    files = _replay_dir(tmp_path, "dcp", 9, 150, False, 0)

    seen = []

    def fn(key, table):
        fr = list(zip(table.column("capture_id").to_pylist(), table.column("frame_no").to_pylist()))
        seen.append(key)
        return pa.table({"vbucket": [key], "frames": [table.num_rows], "first": [fr[0][1]]})

    out = apply.apply_local(files, fn)
    assert seen == sorted(seen) and out.column("vbucket").to_pylist() == seen
    all_in = reader.read_capture_table(files)
    mask = apply.apply_frames_mask("dcp", all_in)
    assert sum(out.column("frames").to_pylist()) == int(mask.sum())
