"""Capture format version 2 (the `node` column), version 1 captures still open everywhere,
and the replay `topology` table on generated multi-node histories (tests/support/capgen.py
generate_cluster): the maps against the generator's truth, both engines alike, and one
continuous history per vbucket whichever nodes served it (tests/support/oracle.py)."""

from __future__ import annotations

import json
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.protocol.dcp.wire.frames import encode_frame
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader
from dcptool.replay.store import schema as S
from dcptool.replay.store.dcp_batch import frames_to_record_batch
from dcptool.replay.store.synapse_batch import build_batch
from tests.support import capgen, oracle

SEEDS = [1, 7, 23, 42]


def _cluster_dir(tmp_path, seed, n=300, **kw):
    caps, truth = capgen.generate_cluster(seed, n_events=n)
    d = tmp_path / f"cluster-{seed}"
    capgen.write_captures(caps, str(d), seed=seed, **kw)
    return reader.find_captures([str(d)]), truth, caps


def run(*args):
    res = CliRunner().invoke(cli, [str(a) for a in args])
    return res.exit_code, res.stdout, res.stderr


# ---------------------------------------------------------------- the node column

def test_node_column_follows_conn_in_both_protocols():
    for protocol in S.PROTOCOLS:
        names = S.column_names(protocol)
        assert names[names.index("conn") + 1] == "node"
        assert dict(S.fields(protocol))["node"] == S.DICT_STR
    assert S.FORMAT_VERSION == "2" and set(S.READABLE_VERSIONS) == {"1", "2"}


def test_batch_builders_fill_node():
    buf = encode_frame(0x80, 0x5C, opaque=1) * 3
    rb, consumed, err = frames_to_record_batch(buf, node="10.0.0.1:11210")
    assert consumed == len(buf) and err is None
    assert rb.schema.field("node").type == S.DICT_STR
    assert rb.column(rb.schema.get_field_index("node")).to_pylist() == ["10.0.0.1:11210"] * 3
    rb, _, _ = frames_to_record_batch(buf)
    assert rb.column(rb.schema.get_field_index("node")).null_count == 3
    lines = [b"PING 1", b"RDATA events master 5 [1]"]
    b = build_batch(lines, frame_no=0, conn=1, ts_ns=0, mono_ns=0, node="[::1]:9092")
    assert b.column(b.schema.get_field_index("node")).to_pylist() == ["[::1]:9092"] * 2
    b = build_batch(lines, frame_no=0, conn=1, ts_ns=0, mono_ns=0)
    assert b.column(b.schema.get_field_index("node")).null_count == 2


# ---------------------------------------------------------------- version 1 captures

def test_version_1_captures_open_everywhere(tmp_path):
    """A v1 capture (no `node` column) reads with node null: replay (every table), inspect,
    verify, diff, resume and playback give what the same rows give as v2 with node null."""
    from dcptool.replay.playback_source import load_dcp
    from dcptool.replay.store.resume import dcp_resume_state
    caps, _ = capgen.generate_cluster(5, n_events=200)
    no_node = [(m, t.set_column(t.schema.get_field_index("node"), t.schema.field("node"),
                                pa.nulls(t.num_rows, S.DICT_STR))) for m, t in caps]
    v1, v2 = tmp_path / "v1", tmp_path / "v2"
    capgen.write_captures(capgen.as_version_1(caps), str(v1), seed=5)
    capgen.write_captures(no_node, str(v2), seed=5)
    one = next(p for p in v1.iterdir())
    assert "node" not in pq.read_schema(one).names
    assert pq.read_schema(one).metadata[S.META_FORMAT.encode()] == b"1"

    f1, f2 = reader.find_captures([str(v1)]), reader.find_captures([str(v2)])
    r1, r2 = local.replay_local(f1), local.replay_local(f2)
    for name in r1.names():
        assert T.checksum(name, r1.table(name)) == T.checksum(name, r2.table(name)), name
    assert r1.table("frames").column("node").null_count == r1.table("frames").num_rows
    # no node: `$HOST` cannot be resolved, and says so
    topo = r1.table("topology")
    assert topo.num_rows and any("$HOST" in (a or "") for a in topo.column("active").to_pylist())

    assert dcp_resume_state([str(v1)]) == dcp_resume_state([str(v2)])
    p1, p2 = load_dcp([str(v1)]), load_dcp([str(v2)])
    assert sorted(p1.streams) == sorted(p2.streams)

    code, out, err = run("inspect", "--json", v1)
    assert code == 0, err
    assert json.loads(out)["nodes"] == {}
    code_v1, out_v1, _ = run("verify", "--format", "jsonl", v1)
    code_v2, out_v2, _ = run("verify", "--format", "jsonl", v2)
    assert code_v1 == code_v2 and code_v1 in (0, 6)
    assert len(out_v1.splitlines()) == len(out_v2.splitlines())
    assert run("diff", v1, v2)[0] == 0
    code, out, err = run("replay", "--checksum", "--format", "jsonl", v1)
    assert code == 0, err


# ---------------------------------------------------------------- topology

@pytest.mark.parametrize("seed", SEEDS)
def test_topology_is_every_config_once_with_its_map(tmp_path, seed):
    files, truth, _ = _cluster_dir(tmp_path, seed, in_progress_last=seed % 2 == 1)
    topo = local.replay_local(files).table("topology")
    got: dict[tuple, list] = {}
    for r in topo.to_pylist():
        got.setdefault((r["rev_epoch"], r["rev"]), []).append(r)
    assert set(got) == set(truth["first"])          # every config a frame carried, once
    for key, rs in got.items():
        want_map = truth["maps"][key]
        assert [r["vbucket"] for r in rs] == list(range(len(want_map)))
        assert [(r["active"], r["replicas"]) for r in rs] == want_map, key
        cid, frame_no, node, via = truth["first"][key]
        assert {(r["capture_id"], r["frame_no"], r["node"], r["via"]) for r in rs} == {(cid, frame_no, node, via)}
    assert topo.equals(T.canonical("dcp", "topology", topo))


def test_generated_cluster_histories_exercise_the_cases(tmp_path):
    """Each source of configs, vbuckets served by several nodes, rollbacks after failover,
    opaques reused on several connections: the other tests would be empty without them."""
    vias, moved, rollbacks, reused = set(), 0, 0, 0
    for seed in SEEDS:
        files, truth, _ = _cluster_dir(tmp_path, seed)
        vias |= {v[3] for v in truth["first"].values()}
        frames = reader.read_capture_table(files).to_pylist()
        served: dict[int, set] = {}
        opaques: dict[int, set] = {}
        for f in frames:
            if f["direction"] == "in" and f["op"] == "mutation":
                served.setdefault(f["vbucket"], set()).add(f["node"])
            if f["direction"] == "out" and f["op"] == "stream_req":
                opaques.setdefault(f["opaque"], set()).add((f["capture_id"], f["conn"]))
        moved += sum(len(n) > 1 for n in served.values())
        reused += sum(len(c) > 1 for c in opaques.values())
        rollbacks += local.replay_local(files).table("rollbacks").num_rows
    assert vias == {"get_cluster_config", "not_my_vbucket", "clustermap_notification"}
    assert moved and rollbacks and reused


@pytest.mark.parametrize("seed", SEEDS)
def test_one_history_per_vbucket_across_nodes(tmp_path, seed):
    """documents / vbuckets / snapshots / rollbacks / failover as the row-by-row oracle has
    them, whichever node served each frame; `undone` agrees with `rollbacks`."""
    files, _, _ = _cluster_dir(tmp_path, seed)
    want = oracle.dcp(files)
    got = local.replay_local(files, chunk_rows=64)
    for name, table in want.items():
        assert got.table(name).equals(table), name
    assert got.table("undone").num_rows == sum(got.table("rollbacks").column("undone").to_pylist())


def test_topology_as_of_keeps_earlier_configs(tmp_path):
    from dcptool.replay.rules.as_of import AsOf
    files, _, _ = _cluster_dir(tmp_path, 7)
    full = local.replay_local(files).table("topology")
    ts = sorted(set(full.column("ts").cast(pa.int64()).to_pylist()))
    cut = ts[len(ts) // 2]
    part = local.replay_local(files, as_of=AsOf(ts_ns=cut)).table("topology")
    keep = np.array(full.column("ts").cast(pa.int64()).to_pylist()) <= cut
    assert part.equals(full.filter(pa.array(keep)))
    assert 0 < part.num_rows < full.num_rows


@pytest.mark.spark
def test_spark_topology_and_tables_equal_local(spark, tmp_path):
    from dcptool.replay.spark import engine as spark_engine
    files, _, _ = _cluster_dir(tmp_path, 23, in_progress_last=True)
    want = local.replay_local(files)
    rep = spark_engine.replay_spark(spark, files)
    try:
        assert want.table("topology").num_rows
        for name in want.names():
            assert T.checksum(name, rep.table(name)) == T.checksum(name, want.table(name)), name
    finally:
        rep.close()


def test_undecodable_config_values_are_no_rows():
    """An empty NOT_MY_VBUCKET body, JSON that is not a bucket config, a torn frame: no row."""
    from dcptool.replay.rules.topology import topology_rows
    cl = capgen._Cluster(random.Random(1), capgen._Run(random.Random(1)), 4)
    value = cl.config_json(0)
    frames = [encode_frame(0x81, 0x53, vbucket_or_status=7, opaque=1),
              encode_frame(0x81, 0x53, vbucket_or_status=7, opaque=2, value=b'{"error":"nope"}'),
              encode_frame(0x81, 0xB5, opaque=3, value=value)[:30],
              encode_frame(0x81, 0xB5, opaque=4, value=value)]
    rows = [dict(capture_id="c", frame_no=i, ts=i, node=cl.addr(0), magic=0x81, opcode=0xB5, status=0,
                 raw=r) for i, r in enumerate(frames)]
    out = topology_rows(rows)
    assert {r["frame_no"] for r in out} == {3} and len(out) == 4
    assert [r["active"] for r in out] == [a for a, _ in cl.truth[(cl.epoch, cl.rev)]]
    assert out[0]["active"] == cl.addr(0)   # $HOST: the host of the frame's node
    # a Snappy value (datatype 0x02) is decompressed; a hostile length preamble is no row
    import cramjam
    packed = bytes(cramjam.snappy.compress_raw(value))
    snappy = [encode_frame(0x81, 0xB5, opaque=5, datatype=0x03, value=b"\xff\xff\xff\xff\x7f" + packed[5:]),
              encode_frame(0x81, 0xB5, opaque=6, datatype=0x03, value=packed)]
    rows = [dict(r, raw=f, frame_no=10 + i) for i, (r, f) in enumerate(zip(rows, snappy))]
    assert {r["frame_no"] for r in topology_rows(rows)} == {11}


def test_inspect_shows_nodes_and_config_revisions(tmp_path):
    files, truth, _ = _cluster_dir(tmp_path, 42)
    code, out, err = run("inspect", "--json", tmp_path / "cluster-42")
    assert code == 0, err
    doc = json.loads(out)
    want_nodes: dict = {}
    for n in reader.read_capture_table(files).column("node").to_pylist():
        want_nodes[n] = want_nodes.get(n, 0) + 1
    assert doc["nodes"] == {k: v for k, v in sorted(want_nodes.items()) if k is not None}
    assert [(c["rev_epoch"], c["rev"]) for c in doc["configs"]] == sorted(truth["first"])
    assert all(c["vbuckets"] == sum(c["active"].values()) > 0 for c in doc["configs"])
    code, out, err = run("inspect", tmp_path / "cluster-42", "--format", "table")
    assert code == 0 and "cluster config revisions" in out and "nodes" in out, err
