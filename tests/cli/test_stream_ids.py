"""Stream IDs (issue 13): the producer's answers (sid required iff enabled, KEY_EEXISTS per
(vbucket, sid), refused with sync writes, close by sid), its alt-framed frames (magic 0x08 +
frame info 0x22) and their flow-control size, and `capture --stream-ids` against `serve dcp`
with two collection groups on every vbucket, through replay (documents = the union of the
two single-filter captures, snapshots tracked per stream), tshark, and a reconnect."""

from __future__ import annotations

import asyncio
import base64
import json
from collections import Counter

import pytest

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.server import manifest as PC
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server import stream_ids as producer_sid
from dcptool.protocol.dcp.server.shared import Scenarios
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import (
    Feature,
    FrameInfoId,
    Status,
    StreamEndReason,
)
from dcptool.protocol.transport.dcp_client import Session
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.cli_util import run
from tests.support.threaded_server import ThreadedServer

ITEM_OPS = ("mutation", "deletion", "expiration")
GROUP_A = "inventory.airline,inventory.route"     # sid 1: two collections
GROUP_B = "tenants.route"                          # sid 2


def sid_info(sid: int) -> tuple:
    return ((FrameInfoId.DCP_STREAM_ID, sid.to_bytes(2, "big")),)


# --------------------------------------------------------------------------- sans-IO producer

def _conn(stream_ids: bool = True, sync_writes: bool = False):
    model = P.server_from_options(vbuckets=2, items=200, seed=3, manifest=PC.Manifest(2, 2))
    conn = model.connect(0.0)
    msgs = [m.Hello(agent=b"t", features=(int(Feature.COLLECTIONS), int(Feature.JSON))),
            m.SelectBucket(bucket=b"default"), m.DcpOpen(name=b"t", flags=1),
            m.Control(key=b"enable_noop", value=b"true"),
            m.Control(key=b"send_stream_end_on_client_close_stream", value=b"true")]
    if sync_writes:
        msgs.append(m.Control(key=b"enable_sync_writes", value=b"true"))
    if stream_ids:
        msgs.append(m.Control(key=b"enable_stream_id", value=b"true"))
    for msg in msgs:
        conn.receive(m.encode(msg), 0.0)
    rsps = [m.decode_bytes(bytes(f)) for f in conn.pull(0.0)]
    return model, conn, rsps


def _req(conn, vb: int, value: bytes, opaque: int):
    conn.receive(m.encode(m.StreamRequest(vbucket=vb, opaque=opaque, flags=0x04, value=value)), 0.0)


def _frames(chunks) -> list[bytes]:
    data = b"".join(bytes(c) for c in chunks)
    out, i = [], 0
    while i < len(data):
        n = 24 + int.from_bytes(data[i + 8:i + 12], "big")
        out.append(data[i:i + n])
        i += n
    return out


def test_enable_stream_id_is_accepted_and_refused_with_sync_writes():
    _, _, rsps = _conn(stream_ids=True)
    assert [r.status for r in rsps][-1] == Status.SUCCESS
    _, _, rsps = _conn(stream_ids=True, sync_writes=True)
    assert [r.status for r in rsps][-2:] == [Status.SUCCESS, Status.NOT_SUPPORTED]


def test_producer_answers_sid_missing_duplicate_and_not_enabled():
    _, conn, _ = _conn(stream_ids=True)
    _req(conn, 0, b"", 100)                                        # no sid while enabled
    _req(conn, 0, b'{"sid":0}', 101)                               # sid out of range
    _req(conn, 0, b'{"sid":1,"collections":["8"]}', 102)
    _req(conn, 0, b'{"sid":1,"collections":["9"]}', 103)           # the same (vb, sid): exists
    _req(conn, 0, b'{"sid":2,"collections":["9"]}', 104)           # another sid, same vbucket
    _req(conn, 1, b'{"sid":1}', 105)                               # same sid, other vbucket
    answers = {}
    for fr in _frames(conn.pull(0.0, limit=1)):
        msg = m.decode_bytes(fr, collections=True)
        if msg.IS_RESPONSE and msg.op_code == 0x53:
            answers[msg.opaque] = msg.status
    assert answers == {100: Status.DCP_STREAM_ID_INVALID, 101: Status.DCP_STREAM_ID_INVALID,
                       102: Status.SUCCESS, 103: Status.KEY_EEXISTS, 104: Status.SUCCESS, 105: Status.SUCCESS}
    _, plain, _ = _conn(stream_ids=False)
    _req(plain, 0, b'{"sid":1}', 7)                                # a sid without enable_stream_id
    rsp = [m.decode_bytes(f) for f in _frames(plain.pull(0.0, limit=1))][0]
    assert rsp.status == Status.DCP_STREAM_ID_INVALID


def test_stream_frames_are_alt_framed_with_their_sid_and_count_three_bytes_more():
    _, conn, _ = _conn(stream_ids=True)
    _req(conn, 0, b'{"sid":7,"collections":["8"]}', 50)
    _, ref, _ = _conn(stream_ids=False)
    _req(ref, 0, b'{"collections":["8"]}', 50)
    got = [f for f in _frames(conn.pull(0.0)) if f[1] != 0x53]
    want = [f for f in _frames(ref.pull(0.0)) if f[1] != 0x53]
    assert len(got) == len(want) and got
    for g, w in zip(got, want):
        assert g[0] == 0x08 and g[2] == 3 and g[24:27] == b"\x22\x00\x07" and len(g) == len(w) + 3
        gm, wm = m.decode_bytes(g, collections=True), m.decode_bytes(w, collections=True)
        assert gm.stream_id == 7 and wm.stream_id is None
        assert m.to_row(gm) | {"magic": 0, "stream_id": None} == m.to_row(wm) | {"magic": 0, "stream_id": None}
    ops = Counter(f[1] for f in got)
    assert ops[0x57] > 0 and ops[0x56] > 0 and ops[0x55] == 1
    # flow control counts what was sent, the 3-byte frame info included
    assert conn.outstanding == sum(len(f) for f in got)
    assert ref.outstanding == conn.outstanding - 3 * len(got)


def test_close_stream_by_sid():
    _, conn, _ = _conn(stream_ids=True)
    _req(conn, 1, b'{"sid":1}', 60)
    _req(conn, 1, b'{"sid":2}', 61)
    conn.pull(0.0, limit=1)
    conn.receive(m.encode(m.CloseStream(vbucket=1, opaque=70)), 0.0)                       # no sid: invalid
    conn.receive(m.encode(m.CloseStream(vbucket=1, opaque=71, frame_infos=sid_info(3))), 0.0)   # not open
    conn.receive(m.encode(m.CloseStream(vbucket=1, opaque=72, frame_infos=sid_info(2))), 0.0)
    msgs = [m.decode_bytes(f, collections=True) for f in _frames(conn._out)]
    closes = {x.opaque: x.status for x in msgs if x.IS_RESPONSE and x.op_code == 0x52}
    assert closes == {70: Status.DCP_STREAM_ID_INVALID, 71: Status.KEY_ENOENT, 72: Status.SUCCESS}
    ends = [x for x in msgs if type(x) is m.StreamEnd]
    assert [(e.stream_id, e.opaque, e.reason) for e in ends] == [(2, 61, StreamEndReason.CLOSED)]
    assert sorted(conn.streams) == [producer_sid.stream_key(1, 1)]


# --------------------------------------------------------------------------- sans-IO consumer

@pytest.mark.parametrize("vectorised", [False, True])
def test_consumer_takes_alt_framed_data_frames_on_its_fast_paths(vectorised, monkeypatch):
    """Both receive paths (per frame; numpy over a whole read) key each data frame by
    (vbucket, sid), so two streams of one vbucket keep their own last seqno."""
    import numpy as np

    from dcptool.protocol.dcp.client import consumer_receive
    from dcptool.protocol.dcp.wire.frames import split
    runs = []
    apply_run = consumer_receive.Receiver._apply_run

    def counted(self, buf, offsets, lengths, a, b, *rest):
        runs.append(b - a)
        return apply_run(self, buf, offsets, lengths, a, b, *rest)
    monkeypatch.setattr(consumer_receive.Receiver, "_apply_run", counted)
    model = P.server_from_options(vbuckets=2, items=1200, seed=3, manifest=PC.Manifest(2, 2))
    prod = model.connect(0.0)
    cfg = dcp_consumer.ConsumerConfig(bucket="default", name="t", collections=True, noop_interval=5.0,
                                      buffer_size=0, stream_ids=True,
                                      collection_names=("inventory.airline", "tenants.route"),
                                      stream_groups=(((), ("inventory.airline",)), ((), ("tenants.route",))))
    cons = dcp_consumer.Consumer(cfg, None, 0.0)
    cons.start(0.0)
    items = Counter()
    for _ in range(10_000):
        if cons.finished:
            break
        for fr in cons.outgoing():
            prod.receive(fr, 0.0)
        data = b"".join(bytes(x) for x in prod.pull(0.0, limit=16384))   # reads of ~150 frames
        bounds, used = split(data)
        assert used == len(data)
        offs, lens = [o for o, _ in bounds], [n for _, n in bounds]
        for o in offs:
            if data[o] == 0x08 and data[o + 1] in (0x57, 0x58, 0x59):
                items[(int.from_bytes(data[o + 6:o + 8], "big"), int.from_bytes(data[o + 25:o + 27], "big"))] += 1
        if vectorised:
            cons.receive(data, np.array(offs, dtype=np.int64), np.array(lens, dtype=np.int64), 0.0)
        else:
            cons.receive(data, offs, lens, 0.0)
    assert cons.finished
    assert cons.receiver.data_frames >= sum(items.values()) > 0          # every item took a fast path
    assert (max(runs, default=0) >= 48) == vectorised           # whole reads applied column-wise
    assert sorted(items) == [(vb, sid) for vb in range(2) for sid in (1, 2)]
    states = cons.streams.resume_state()
    bucket = model.buckets["default"]
    man = bucket.manifest
    for vb in range(2):
        assert sorted(states[vb].streams) == [1, 2]
        for sid, name in ((1, "inventory.airline"), (2, "tenants.route")):
            cid = man.find(*name.split(".")).cid
            top = max(it.seqno for it in bucket.vbuckets[vb].items() if it.cid == cid)
            assert cons.streams.last_seqno(vb, sid) >= top     # at the stream's end (a seqno advanced may follow)
            assert states[vb].streams[sid].last_seqno == cons.streams.last_seqno(vb, sid)


# --------------------------------------------------------------------------- end to end

def model_with(items=1500, vbuckets=4, scenarios=None, mutate=0):
    model = P.server_from_options(vbuckets=vbuckets, items=items, seed=11, manifest=PC.Manifest(2, 2),
                                  scenarios=scenarios, checkpoint_items=40)
    if mutate:
        model.buckets["default"].mutate_random(mutate)   # memory snapshots after the backfill
    return model


def cids(model, *names) -> set:
    man = model.buckets["default"].manifest
    return {man.find(*n.split(".")).cid for n in names}


def want_docs(model, ids) -> set:
    return {(vb.vbid, it.cid, it.key) for vb in model.buckets["default"].vbuckets
            for it in vb.items() if it.kind == "m" and it.cid in ids}


def replay_docs(out) -> set:
    res = run("replay", out, "--table", "documents", "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    return {(d["vbucket"], d["collection_id"], d["key"].encode()) for d in map(json.loads, res.stdout.splitlines())}


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """One --stream-ids capture of two groups and one capture per group alone, of the same
    data (backfill and memory snapshots)."""
    base = tmp_path_factory.mktemp("sid")
    model = model_with(mutate=300)
    outs = {k: str(base / k) for k in ("both", "a", "b")}
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        for key, args in (("both", ["--stream-ids", "--collection", GROUP_A, "--collection", GROUP_B]),
                          ("a", ["--collection", GROUP_A]), ("b", ["--collection", GROUP_B])):
            res = run("capture", url, "-o", outs[key], "--quiet", "--json", *args)
            assert res.returncode == 0, res.stderr
    return model, outs


@pytest.mark.integration
def test_two_stream_ids_per_vbucket_capture_and_replay_the_union(captures):
    model, outs = captures
    t = read_capture_table(find_captures([outs["both"]]))
    rows = t.select(["direction", "op", "magic", "vbucket", "stream_id", "collection_id", "key"]).to_pylist()
    ins = [r for r in rows if r["direction"] == "in" and r["op"] in (*ITEM_OPS, "snapshot_marker", "stream_end",
                                                                     "seqno_advanced")]
    # every stream frame is alt-framed and has its stream id; each group's items are its own
    assert ins and all(r["magic"] == 0x08 and r["stream_id"] in (1, 2) for r in ins)
    a, b = cids(model, *GROUP_A.split(",")), cids(model, GROUP_B)
    items = [r for r in ins if r["op"] in ITEM_OPS]
    assert all(r["collection_id"] in (a if r["stream_id"] == 1 else b) for r in items)
    assert {(r["vbucket"], r["stream_id"]) for r in ins if r["op"] == "stream_end"} == \
        {(vb, sid) for vb in range(4) for sid in (1, 2)}
    # documents: exactly the union of the two single-filter captures
    docs = replay_docs(outs["both"])
    assert docs == replay_docs(outs["a"]) | replay_docs(outs["b"])
    assert docs >= want_docs(model, a | b) and {c for _, c, _ in docs} == a | b
    # the options record the stream ids and each one's filter
    opts = json.loads(find_captures([outs["both"]])[0].metadata["dcptool.options"])
    assert opts["stream_ids"] is True
    assert opts["stream_filters"] == [{"collections": ["8", "9"], "uid": "1"}, {"collections": ["b"], "uid": "1"}]
    check = run("verify", outs["both"], "--format", "jsonl")
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.integration
def test_snapshots_are_tracked_per_stream_id(captures):
    """Two streams' markers interleave on one vbucket: each snapshot holds its own stream's
    items, and is complete."""
    from dcptool.replay.local import engine as local
    _, outs = captures
    files = find_captures([outs["both"]])
    t = read_capture_table(files, ["direction", "op", "vbucket", "stream_id", "frame_no", "capture_id"])
    want, current = {}, {}
    for r in t.to_pylist():
        if r["direction"] != "in" or r["stream_id"] is None:
            continue
        s = (r["vbucket"], r["stream_id"])
        if r["op"] == "snapshot_marker":
            current[s] = (r["capture_id"], r["frame_no"])
            want[current[s]] = 0
        elif r["op"] in ITEM_OPS:
            want[current[s]] += 1
    snaps = local.replay_local(files).table("snapshots").to_pylist()
    got = {(x["capture_id"], x["frame_no"]): x["items"] for x in snaps}
    assert got == want
    # the markers of the two streams do interleave on a vbucket (or this proves nothing)
    order = [r["stream_id"] for r in t.to_pylist() if r["op"] == "snapshot_marker" and r["vbucket"] == 0]
    assert any(x != y for x, y in zip(order, order[1:]))
    assert all(x["complete"] for x in snaps)


@pytest.mark.spark
@pytest.mark.integration
def test_spark_agrees_with_local_on_a_stream_id_capture(captures, spark):
    from dcptool.replay.local import engine as local
    from dcptool.replay.rules import tables as T
    from dcptool.replay.spark import engine as spark_engine
    _, outs = captures
    files = find_captures([outs["both"]])
    ref = local.replay_local(files)
    got = spark_engine.replay_spark(spark, files)
    for name in ("documents", "vbuckets", "snapshots"):
        assert T.checksum(name, got.table(name)) == T.checksum(name, ref.table(name)), name


@pytest.mark.integration
def test_a_reconnect_keeps_the_stream_ids_and_their_filters():
    model = model_with(items=3000, scenarios=Scenarios(disconnect_after=500))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("stream", url, "--format", "jsonl", "--raw", "--stream-ids", "--collection", GROUP_A,
                  "--scope", "tenants")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    reqs = [(r["conn"], r["vbucket"], json.dumps(json.loads(m.decode_bytes(base64.b64decode(r["raw"])).value),
                                                 sort_keys=True))
            for r in rows if r["op"] == "stream_req" and r["direction"] == "out"]
    assert {c for c, _, _ in reqs} == {1, 2}
    for conn in (1, 2):
        values = sorted({v for c, _, v in reqs if c == conn})
        assert values == [json.dumps({"collections": ["8", "9"], "sid": 1, "uid": "1"}, sort_keys=True),
                          json.dumps({"scope": "9", "sid": 2, "uid": "1"}, sort_keys=True)]
    a, b = cids(model, *GROUP_A.split(",")), cids(model, "tenants.airline", "tenants.route")
    got = {(r["vbucket"], r["collection_id"], r["key"].encode()) for r in rows
           if r["direction"] == "in" and r["op"] in ITEM_OPS}
    assert got == want_docs(model, a | b)
    # the second connection resumed each (vbucket, sid) stream from its own seqno
    second = [r for r in rows if r["op"] == "stream_req" and r["direction"] == "out" and r["conn"] == 2]
    assert any(r["req_start_seqno"] > 0 for r in second)


@pytest.mark.integration
def test_stream_ids_refused_by_the_server_exit_5():
    model = model_with(items=100)
    with ThreadedServer(model) as srv:
        res = run("stream", f"couchbase://{srv.host}:{srv.port}/default", "--format", "jsonl", "--stream-ids",
                  "--sync-writes")
    assert res.returncode == 5 and "enable_stream_id" in res.stderr, res.stderr


@pytest.mark.integration
def test_capture_resume_continues_each_stream_id_from_its_own_position(tmp_path):
    """A capture with two stream ids stopped part way, then `capture --resume` with no
    options: the same stream ids and filters, each (vbucket, sid) stream from its own last
    seqno (no item twice, none missing); other stream options are a usage error."""
    model = model_with(items=3000, mutate=200)
    out = str(tmp_path / "c")
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        first = run("capture", url, "-o", out, "--quiet", "--json", "--stream-ids", "--collection", GROUP_A,
                    "--scope", "tenants", "--max-messages", "700", "--buffer-size", "8192")
        assert first.returncode == 0, first.stderr
        assert json.loads(first.stdout)["stopped"] == "max-messages"
        for wrong in (("--scope", "inventory"), ("--stream-ids", "--scope", "tenants")):
            res = run("capture", url, "-o", out, "--quiet", "--resume", *wrong)
            assert res.returncode == 2 and "--resume keeps" in res.stderr and "Traceback" not in res.stderr, res.stderr
        again = run("capture", url, "-o", out, "--quiet", "--json", "--resume")
        assert again.returncode == 0, again.stderr
    t = read_capture_table(find_captures([out])).to_pylist()
    items = [(r["vbucket"], r["stream_id"], r["by_seqno"]) for r in t
             if r["direction"] == "in" and r["op"] in ITEM_OPS]
    assert len(items) == len(set(items))
    a, b = cids(model, *GROUP_A.split(",")), cids(model, "tenants.airline", "tenants.route")
    assert {(r["vbucket"], r["collection_id"], r["key"]) for r in t
            if r["direction"] == "in" and r["op"] in ITEM_OPS} == want_docs(model, a | b)
    assert replay_docs(out) == want_docs(model, a | b)
    reqs = [r for r in t if r["op"] == "stream_req" and r["direction"] == "out"]
    resumed = [r for r in reqs if r["capture_id"] != reqs[0]["capture_id"]]
    assert {r["stream_id"] for r in resumed} == {1, 2}
    # the two streams of a vbucket were at different seqnos when the first run stopped
    starts = {}
    for r in resumed:
        starts.setdefault(r["vbucket"], {})[r["stream_id"]] = r["req_start_seqno"]
    assert any(len(set(x.values())) > 1 for x in starts.values()), starts


# --------------------------------------------------------------------------- tshark

@pytest.mark.integration
def test_alt_framed_stream_frames_decode_the_same_in_tshark():
    from tests.support.tshark_util import (
        Recorder,
        compare,
        require_tshark,
        tshark_frames,
    )
    require_tshark()
    model = model_with(items=200, vbuckets=2, mutate=60)
    rec = Recorder()
    with ThreadedServer(model) as srv:
        cfg = dcp_consumer.ConsumerConfig(bucket="default", name="tshark", collections=True, buffer_size=4096,
                                          noop_interval=5, stream_ids=True,
                                          collection_names=("inventory.airline", "tenants.route"),
                                          stream_groups=(((), ("inventory.airline",)), ((), ("tenants.route",))))
        consumer = asyncio.run(asyncio.wait_for(Session(cfg, srv.host, srv.port, tap=rec).run(), 60))
        port = srv.port
    assert consumer.finished
    pdus = tshark_frames(rec.segments, port=port)
    assert len(pdus) == len(rec.frames)
    problems, sids = [], Counter()
    for (_, raw), ts in zip(rec.frames, pdus):
        row = m.to_row(m.decode_bytes(raw, collections=True))
        assert row.get("decode_error") is None, row
        if raw[0] == 0x08:     # alt framing: the stream id is a frame info tshark reads too
            sids[(row["op"], row["stream_id"])] += 1
            assert ts.get("couchbase.flex_frame.frame.dcp_stream_id") is not None, row["op"]
        problems += [f"{row['op']}: {d}" for d in compare(row, raw, ts)]
    assert problems == []
    for op in ("snapshot_marker", "mutation", "stream_end"):
        assert sids[(op, 1)] > 0 and sids[(op, 2)] > 0, op


# --------------------------------------------------------------------------- cluster

@pytest.mark.integration
def test_stream_ids_follow_a_rebalance_with_their_sids_and_filters():
    """A rebalance moves vbuckets to other nodes: each (vbucket, sid) stream reopens there
    with its own sid, filter and position, and ends with exactly its collections' documents."""
    from dcptool.protocol.dcp.server.cluster import Event
    model = P.server_from_options(vbuckets=16, items=3000, seed=5, nodes=3, replicas=1,
                                  events=(Event(1200, "rebalance"),), manifest=PC.Manifest(2, 2),
                                  scenarios=Scenarios(slow=0.01, slow_frames=16))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("stream", url, "--format", "jsonl", "--stream-ids", "--collection", GROUP_A,
                  "--collection", GROUP_B)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert model.cluster.changes
    moved = {(r["vbucket"], r["stream_id"]) for r in rows if r["op"] == "stream_end" and r["stream_end_reason"] == 2}
    assert {sid for _, sid in moved} == {1, 2}
    groups = {1: cids(model, *GROUP_A.split(",")), 2: cids(model, GROUP_B)}
    got: dict = {}
    for r in rows:
        if r["direction"] == "in" and r["op"] in ITEM_OPS:
            s = (r["vbucket"], r["stream_id"])
            assert r["collection_id"] in groups[r["stream_id"]]
            assert r["by_seqno"] > got.get(s, {}).get("_last", 0), s      # each stream's seqnos only rise
            got.setdefault(s, {})[r["key"].encode()] = r["by_seqno"]
            got[s]["_last"] = r["by_seqno"]
    want = {}
    for vb in model.buckets["default"].vbuckets:
        for key, it in vb.latest().items():
            for sid, ids in groups.items():
                if it.cid in ids:
                    want.setdefault((vb.vbid, sid), {})[key] = it.seqno
    assert {s: {k: v for k, v in d.items() if k != "_last"} for s, d in got.items()} == want
