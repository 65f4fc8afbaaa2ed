"""OSO backfills (issue 13): the producer's OSO snapshot (key order between OSO markers, a
seqno advanced to its end, memory snapshots in order after it), the consumer's resume point
inside and after one, and `stream` / `capture` / `capture --resume` / `replay` (both engines)
with --oso against the built-in producer with several scopes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.server import manifest as PC
from dcptool.protocol.dcp.server import oso as producer_oso
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import messages as m
from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import find_captures, read_capture_table
from dcptool.replay.store.resume import dcp_resume_state
from tests.support.cli_util import run
from tests.support.dcp_pair import Pair, cfg
from tests.support.threaded_server import ThreadedServer

AIRLINE = 8                     # inventory.airline in PC.Manifest(2, 2)
FILTER = {"collections": ["8"], "uid": "1"}
DOC_COLS = ["vbucket", "collection_id", "key", "by_seqno", "rev_seqno", "cas", "state", "value_len"]


def shuffled_model(seed: int, *, live: int = 200, items: int = 400, scenarios=None):
    """4 vbuckets, `_default` + inventory.{airline,route} + tenants.{airline,route}; the disk
    documents of each vbucket written in a seeded random order (the generator writes them in
    key order, where OSO would look like seqno order), then `live` seeded live changes."""
    model = P.server_from_options(vbuckets=4, items=items, seed=seed, checkpoint_items=20,
                                  manifest=PC.Manifest(2, 2), scenarios=scenarios)
    b = model.buckets["default"]
    rng = np.random.default_rng(seed)
    for vb in b.vbuckets:
        perm = rng.permutation(vb.disk_high)
        vb.disk_keys, vb.disk_values, vb.disk_cids = vb.disk_keys[perm], vb.disk_values[perm], vb.disk_cids[perm]
    b.mutate_random(live)
    return model


def frames_of(pair, vb: int) -> list:
    out = []
    for raw in pair.inbound:
        msg = m.decode_bytes(raw, True)
        if getattr(msg, "vbucket", None) == vb and not msg.IS_RESPONSE and msg.op_code != 0x5C:
            out.append(msg)
    return out


# --------------------------------------------------------------------------- sans-IO

def test_key_order_is_not_seqno_order():
    model = shuffled_model(1, live=0)
    vb = model.buckets["default"].vbuckets[0]
    seqnos = producer_oso.key_order(vb, vb.disk_high, {AIRLINE})
    keys = [bytes(vb.disk_keys[s - 1]) for s in seqnos]
    assert len(seqnos) > 10 and keys == sorted(keys)
    assert list(seqnos) != sorted(seqnos)
    assert set(seqnos) == {s for s in range(1, vb.disk_high + 1) if vb.disk_cids[s - 1] == AIRLINE}


@pytest.mark.parametrize("compress", [False, True])
def test_oso_backfill_then_memory_snapshots_in_order(compress):
    model = shuffled_model(2)
    pair = Pair(model, cfg(collections=True, oso=True, stream_filter=FILTER, compress=compress)).run()
    assert pair.cons.finished and pair.cons.handshake.controls["enable_out_of_order_snapshots"] == "true_with_seqno_advanced"
    b = model.buckets["default"]
    for vb in b.vbuckets:
        fr = frames_of(pair, vb.vbid)
        assert type(fr[0]) is m.OsoSnapshot and fr[0].flags == 0x01
        end = next(i for i, f in enumerate(fr) if type(f) is m.OsoSnapshot and f.flags == 0x02)
        inside = fr[1:end]
        items = [f for f in inside if type(f) is m.Mutation]
        assert [f.key for f in items] == sorted(f.key for f in items)
        assert {f.collection_id for f in items} == {AIRLINE}
        assert all(bool(f.datatype & 0x02) == compress for f in items)
        want = {s for s in range(1, vb.disk_high + 1) if vb.disk_cids[s - 1] == AIRLINE}
        assert {f.by_seqno for f in items} == want
        # the backfill's last seqno is another collection's: a seqno advanced to it, last
        adv = [f for f in inside if type(f) is m.SeqnoAdvanced]
        if max(want) != vb.disk_high:
            assert inside[-1] == adv[0] and adv[0].by_seqno == vb.disk_high and len(adv) == 1
        # after it: normal markers, memory snapshots, seqnos rising from the backfill's end
        after = fr[end + 1:]
        assert not any(type(f) is m.OsoSnapshot for f in after)
        markers = [f for f in after if type(f) is m.SnapshotMarker]
        assert markers and markers[0].snap_start == vb.disk_high + 1
        assert all(mk.snap_flags & 0x01 for mk in markers)
        seqs = [f.by_seqno for f in after if type(f) in (m.Mutation, m.Deletion, m.Expiration)]
        assert seqs == sorted(seqs) and all(s > vb.disk_high for s in seqs)
    # the consumer's resume point after the OSO end: the highest seqno received
    state = pair.cons.streams.resume_state()
    for vb in b.vbuckets:
        seqnos = [f.by_seqno for f in frames_of(pair, vb.vbid) if getattr(f, "by_seqno", None) is not None]
        assert state[vb.vbid].last_seqno == max(seqnos)
    assert any(list(f.by_seqno for f in frames_of(pair, v.vbid) if type(f) is m.Mutation)
               != sorted(f.by_seqno for f in frames_of(pair, v.vbid) if type(f) is m.Mutation) for v in b.vbuckets)


def test_no_oso_without_the_control_or_for_a_scope_filter():
    model = shuffled_model(3, live=0)
    plain = Pair(model, cfg(collections=True, stream_filter=FILTER)).run()
    scope = Pair(model, cfg(collections=True, oso=True, stream_filter={"scope": "8", "uid": "1"})).run()
    for pair in (plain, scope):
        assert pair.cons.finished
        assert not any(type(m.decode_bytes(r, True)) is m.OsoSnapshot for r in pair.inbound)
        assert type(frames_of(pair, 0)[0]) is m.SnapshotMarker


def test_plain_true_sends_no_seqno_advanced():
    model = shuffled_model(4, live=0)
    conn = model.connect(0.0)
    conn.features = {0x12}          # collections
    conn.bucket = model.buckets["default"]
    conn.controls["enable_out_of_order_snapshots"] = "true"
    vb = model.buckets["default"].vbuckets[1]
    st = P.Stream(conn, vb, 7, 0, vb.disk_high, None)
    st.flt = PC.Filter(cids={AIRLINE})
    assert producer_oso.uses_oso(st)
    kinds = [kind for kind, _ in producer_oso.oso_backfill(st, vb.disk_high)]
    frames = producer_oso.oso_backfill(st, vb.disk_high)[-1][1]
    assert kinds == ["frames", "records", "frames"]
    assert [type(m.decode_bytes(f, True)) for f in frames] == [m.OsoSnapshot]
    st2 = P.Stream(conn, vb, 7, 5, vb.disk_high, None)     # not the initial backfill: in order
    st2.flt = PC.Filter(cids={AIRLINE})
    assert not producer_oso.uses_oso(st2)


def test_consumer_resumes_inside_an_oso_snapshot_from_its_start():
    # the server drops the connection in the middle of the OSO backfills
    model = shuffled_model(5, scenarios=P.Scenarios(disconnect_after=25))
    first = Pair(model, cfg(collections=True, oso=True, stream_filter=FILTER)).run()
    assert first.prod.closed and not first.cons.finished
    state = first.cons.streams.resume_state()
    b = model.buckets["default"]
    started = {f.vbucket for r in first.inbound if type(f := m.decode_bytes(r, True)) is m.OsoSnapshot}
    ended = {f.vbucket for r in first.inbound if type(f := m.decode_bytes(r, True)) is m.OsoSnapshot
             and f.flags == 0x02}
    cut = started - ended
    assert cut         # some vbucket was cut inside its OSO snapshot
    # items came, but the resume point stays at the snapshot's start
    assert any(type(f) is m.Mutation for vb in cut for f in frames_of(first, vb))
    for vb in cut:
        assert state[vb].last_seqno == 0 and first.cons.streams.last_seqno(vb) == 0
    for vb in ended:
        assert state[vb].last_seqno >= b.vbuckets[vb].disk_high
    second = Pair(model, cfg(collections=True, oso=True, stream_filter=FILTER), resume=state).run()
    assert second.cons.finished and not second.of(dcp_consumer.Rollback)
    for vb in cut:     # the snapshot again, whole
        fr = frames_of(second, vb)
        assert type(fr[0]) is m.OsoSnapshot and fr[0].flags == 0x01
    # every document of the collection, at its latest version, across the two connections
    got = {}
    for pair in (first, second):
        for raw in pair.inbound:
            f = m.decode_bytes(raw, True)
            if type(f) in (m.Mutation, m.Deletion, m.Expiration):
                got[(f.vbucket, f.key)] = f.by_seqno
    want = {(vb.vbid, it.key): it.seqno for vb in b.vbuckets for it in vb.latest().values() if it.cid == AIRLINE}
    assert got == want


# --------------------------------------------------------------------------- end to end

def capture(url, out, *args):
    res = run("capture", url, "-o", str(out), "--quiet", "--json", "--collection", "inventory.airline", *args)
    assert res.returncode == 0, res.stderr
    return res


def documents(files) -> list[dict]:
    t = local.replay_local(files).table("documents")
    return sorted(t.select(DOC_COLS).to_pylist(), key=lambda r: (r["vbucket"], r["key"]))


@pytest.fixture(scope="module")
def oso_captures(tmp_path_factory):
    """The same stream captured with and without --oso, and one killed inside the OSO
    snapshots (--max-messages) and resumed with `capture --resume`."""
    base = tmp_path_factory.mktemp("oso")
    # paced (small send batches), so that --max-messages stops the first run inside the OSO snapshots
    # (paced enough that the first run's stop, slower on a loaded host, still lands inside them)
    model = shuffled_model(6, items=800, live=300, scenarios=P.Scenarios(slow=0.02, slow_frames=8))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        capture(url, base / "oso", "--oso")
        capture(url, base / "plain")
        capture(url, base / "resumed", "--oso", "--max-messages", "60")
        cut = find_captures([str(base / "resumed")])
        capture(url, base / "resumed", "--resume")
    return model, {name: find_captures([str(base / name)]) for name in ("oso", "plain", "resumed")}, cut


def cut_inside_oso(files) -> set[int]:
    """The vbuckets with an OSO snapshot that started on a connection of `files` and did not
    end on it, with items in it."""
    rows = read_capture_table(files).select(["capture_id", "conn", "direction", "op", "vbucket",
                                             "snap_flags"]).to_pylist()
    started, ended, items = set(), set(), set()
    for r in rows:
        at = (r["capture_id"], r["conn"], r["vbucket"])
        if r["direction"] == "in" and r["op"] == "oso_snapshot":
            (started if r["snap_flags"] == 0x01 else ended).add(at)
        elif r["direction"] == "in" and r["op"] == "mutation" and at in started - ended:
            items.add(at)
    return {at[2] for at in (started - ended) & items}


@pytest.mark.integration
def test_capture_and_replay_oso_equals_the_capture_without(oso_captures):
    model, files, _ = oso_captures
    opts = json.loads(files["oso"][0].metadata["dcptool.options"])
    assert opts["oso"] is True and "enable_out_of_order_snapshots" in opts["required_controls"]
    assert opts["dcp_controls"]["enable_out_of_order_snapshots"] == "true_with_seqno_advanced"
    assert documents(files["oso"]) == documents(files["plain"])
    rep = local.replay_local(files["oso"])
    snaps = rep.table("snapshots").to_pylist()
    oso = [s for s in snaps if s["snap_version"] == "oso"]
    b = model.buckets["default"]
    assert len(oso) == b.num_vbuckets and all(s["complete"] and s["snap_flags"] is None for s in oso)
    for s in oso:          # one snapshot: its range from its items and the seqno advanced to its end
        vb = b.vbuckets[s["vbucket"]]
        assert s["snap_end"] == vb.disk_high and s["items"] == int((vb.disk_cids == AIRLINE).sum())
    vbs = {r["vbucket"]: r for r in rep.table("vbuckets").to_pylist()}
    plain_vbs = {r["vbucket"]: r for r in local.replay_local(files["plain"]).table("vbuckets").to_pylist()}
    for v, r in vbs.items():
        assert r["high_seqno"] == plain_vbs[v]["high_seqno"] and r["last_snapshot_complete"]
        assert r["snapshots"] == plain_vbs[v]["snapshots"]
    res = run("verify", *[f.path for f in files["oso"]])
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(x) for x in run("replay", str(files["oso"][0].path), "--table", "snapshots",
                                          "--format", "jsonl").stdout.splitlines()]
    assert sum(1 for r in rows if r["snap_version"] == "oso") == b.num_vbuckets


@pytest.mark.integration
def test_capture_resumed_inside_the_oso_snapshot_restarts_it(oso_captures):
    model, files, cut = oso_captures
    inside = cut_inside_oso(cut)
    assert inside         # the first run stopped inside OSO snapshots: they resume from their start
    state = dcp_resume_state(cut)
    assert all(state[vb].last_seqno == 0 and state[vb].failover_log for vb in inside)
    assert len({f.capture_id for f in files["resumed"]}) == 2
    # verify: no rewind (the second run starts where the first stood, before the snapshots)
    res = run("verify", *[f.path for f in files["resumed"]])
    assert res.returncode == 0, res.stdout + res.stderr
    assert documents(files["resumed"]) == documents(files["plain"])
    rep = local.replay_local(files["resumed"])
    oso = [s for s in rep.table("snapshots").to_pylist() if s["snap_version"] == "oso"]
    assert sum(1 for s in oso if not s["complete"]) == len(inside)
    vbs = local.replay_local(files["plain"]).table("vbuckets").to_pylist()
    assert {r["vbucket"]: r["high_seqno"] for r in rep.table("vbuckets").to_pylist()} == \
        {r["vbucket"]: r["high_seqno"] for r in vbs}


@pytest.mark.integration
def test_high_seqno_waits_for_the_oso_end(oso_captures):
    _, _, cut = oso_captures
    rep = local.replay_local(cut)
    inside = cut_inside_oso(cut)
    vbs = {r["vbucket"]: r for r in rep.table("vbuckets").to_pylist()}
    snaps = {s["vbucket"]: s for s in rep.table("snapshots").to_pylist() if s["snap_version"] == "oso"}
    for vb in inside:      # items received, but the vbucket is consistent only up to the start (0)
        assert snaps[vb]["items"] > 0 and not snaps[vb]["complete"]
        assert vbs[vb]["high_seqno"] is None and vbs[vb]["last_snapshot_complete"] is False
        assert vbs[vb]["mutations"] == snaps[vb]["items"]


@pytest.mark.spark
@pytest.mark.integration
def test_spark_equals_local_on_an_oso_capture(spark, oso_captures):
    from dcptool.replay.spark import engine as spark_engine
    _, files, _ = oso_captures
    for name in ("oso", "resumed"):
        want = local.replay_local(files[name])
        rep = spark_engine.replay_spark(spark, files[name])
        try:
            for table in want.names():
                assert rep.table(table).equals(want.table(table)), (name, table)
        finally:
            rep.close()


@pytest.mark.integration
def test_refused_oso_control_is_fatal():
    model = P.server_from_options(vbuckets=2, items=50, manifest=PC.Manifest(2, 2),
                                  scenarios=P.Scenarios(refuse_controls=("enable_out_of_order_snapshots",)))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("stream", url, "--oso", "--collection", "inventory.airline")
        assert res.returncode == 5, res.stderr
        err = [ln for ln in res.stderr.splitlines() if ln.startswith("dcptool:")]
        assert len(err) == 1 and "enable_out_of_order_snapshots" in err[0] and "not_supported" in err[0]
        assert "Traceback" not in res.stderr
        assert run("stream", url, "--collection", "inventory.airline").returncode == 0


@pytest.mark.integration
def test_oso_frames_decode_the_same_in_tshark():
    import asyncio
    from collections import Counter

    from dcptool.protocol.transport.dcp_client import Session
    from tests.support.tshark_util import (
        Recorder,
        compare,
        require_tshark,
        tshark_frames,
    )
    require_tshark()
    model = shuffled_model(7, items=200, live=40)
    rec = Recorder()
    with ThreadedServer(model) as srv:
        conf = cfg(collections=True, oso=True, stream_filter=FILTER, buffer_size=4096, noop_interval=5)
        consumer = asyncio.run(asyncio.wait_for(Session(conf, srv.host, srv.port, tap=rec).run(), 60))
        port = srv.port
    assert consumer.finished
    pdus = tshark_frames(rec.segments, port=port)
    assert len(pdus) == len(rec.frames)
    problems, ops = [], Counter()
    for (from_server, raw), ts in zip(rec.frames, pdus):
        row = m.to_row(m.decode_bytes(raw, collections=True))
        assert row.get("decode_error") is None, row
        ops[row["op"]] += 1
        problems += [f"{row['op']}: {d}" for d in compare(row, raw, ts)]
        if row["op"] == "oso_snapshot":      # tshark names the OSO flags
            assert int(ts["couchbase.extras.dcp_oso_snapshot_flags"]) == row["snap_flags"] in (1, 2)
    assert problems == []
    assert ops["oso_snapshot"] == 2 * model.buckets["default"].num_vbuckets and ops["seqno_advanced"] > 0


def test_verify_follows_the_oso_rules(tmp_path):
    from dcptool.replay.check import verify as V
    from tests.support.capture_rows import Run, checks, write

    def oso(r, flags):
        row = r.add("in", op="oso_snapshot", vbucket=0, opaque=r.opaque, snap_flags=flags)
        row["raw"] = m.encode(m.OsoSnapshot(vbucket=0, opaque=r.opaque, flags=flags))

    def items(r, seqnos):
        for s in seqnos:
            r.add("in", op="mutation", vbucket=0, opaque=r.opaque, by_seqno=s, rev_seqno=1, key=b"k%d" % s)

    def cut_then(resume_from):
        r = Run(1, vbuckets=(0,))
        r.request(0)
        oso(r, 0x01)
        items(r, [7, 2, 5])
        r.conn += 1                       # the connection drops inside the OSO snapshot
        r.request(0, start=resume_from)
        oso(r, 0x01)
        items(r, [7, 2, 5, 3])
        r.add("in", op="seqno_advanced", vbucket=0, opaque=r.opaque, by_seqno=9)
        oso(r, 0x02)
        r.last[0] = 9
        r.snapshot(0, 3)
        r.add("in", op="stream_end", vbucket=0, opaque=r.opaque, stream_end_reason=0)
        return r.rows

    write(cut_then(0), tmp_path / "ok")
    assert checks(V.verify([str(tmp_path / "ok")])) == []
    # resuming from the highest seqno seen inside the cut snapshot skips what it did not send yet
    write(cut_then(7), tmp_path / "gap")
    assert checks(V.verify([str(tmp_path / "gap")])) == ["dcp.resume_gap"]
    # a stream that ends OK inside an OSO snapshot
    r = Run(2, vbuckets=(0,))
    r.request(0)
    oso(r, 0x01)
    items(r, [4, 1])
    r.add("in", op="stream_end", vbucket=0, opaque=r.opaque, stream_end_reason=0)
    write(r.rows, tmp_path / "end")
    assert checks(V.verify([str(tmp_path / "end")])) == ["dcp.oso_not_closed"]


@pytest.mark.integration
def test_replay_rules_agree_whatever_the_chunks(oso_captures):
    """DcpState fed a few rows at a time (an OSO snapshot spread over many chunks) gives the
    tables of one pass over everything."""
    import pyarrow as pa

    from dcptool.replay.rules import dcp_vbuckets as R
    _, files, _ = oso_captures
    t = read_capture_table(files["resumed"])
    t = t.append_column("_seq", pa.array(np.arange(t.num_rows, dtype=np.int64)))
    t = t.filter(pa.array(R.dcp_vbucket_frames(t))).select(R.DCP_STATE_COLUMNS + ["_seq"])
    whole = R.dcp_group_tables(t)
    state = R.DcpState(t.filter(pa.array(R.rollback_mask(t))))
    for at in range(0, t.num_rows, 5):
        state.feed(t.slice(at, 5))
    parts = state.finish()
    for name in ("snapshots", "vbuckets"):
        assert parts[name].equals(whole[name]), name
    assert any(s["snap_version"] == "oso" for s in whole["snapshots"].to_pylist())


@pytest.mark.integration
def test_capture_reconnects_inside_the_oso_snapshot(tmp_path):
    """The server drops the connection inside the OSO snapshots; the capture re-opens and
    asks again from before them: the same documents as an undisturbed capture."""
    dropped = shuffled_model(8, scenarios=P.Scenarios(disconnect_after=30))
    calm = shuffled_model(8)
    for model, out in ((dropped, tmp_path / "d"), (calm, tmp_path / "c")):
        with ThreadedServer(model) as srv:
            capture(f"couchbase://{srv.host}:{srv.port}/default", out, "--oso")
    files = find_captures([str(tmp_path / "d")])
    conns = set(read_capture_table(files).column("conn").to_pylist())
    assert len(conns) == 2
    assert cut_inside_oso(files)        # the first connection stopped inside OSO snapshots
    assert documents(files) == documents(find_captures([str(tmp_path / "c")]))
    res = run("verify", *[f.path for f in files])
    assert res.returncode == 0, res.stdout + res.stderr
