"""Cluster-map change notifications (docs/CLUSTER.md "When the map changes"): HELLO Duplex +
ClustermapChangeNotification (0x0d, the whole config pushed) or its brief form (0x1f, only
(revEpoch, rev)); the server request (magic 0x82, opcode 0x01) is answered with magic 0x83
and re-routes streams at once, without waiting for `--config-poll`. Sans-IO units for the
consumer and the producer, hostile pushes, and `stream` / `capture` + `replay` against
`serve dcp --nodes 3 --replicas 1`. Everything on 127.0.0.1, bounded in time."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import subprocess

import orjson
import pytest

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.client.consumer import (
    ConfigPushed,
    Consumer,
    ConsumerConfig,
    PushIgnored,
    StreamEnded,
)
from dcptool.protocol.dcp.client.consumer_receive import MAX_PUSHED_CONFIG
from dcptool.protocol.dcp.client.routing import MapApplied, Router
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import Bucket
from dcptool.protocol.dcp.server.cluster import (
    NOTIFY_OPAQUE_BASE,
    Cluster,
    Event,
    notify_mode,
)
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.cluster_config import parse
from dcptool.protocol.dcp.wire.columnar import scan
from dcptool.protocol.dcp.wire.constants import Feature, StreamEndReason
from dcptool.protocol.transport.dcp_cluster import ClusterSession, _Link
from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.cluster_state import final_state, survivors
from tests.support.hostile_dcp import HostileDcp, mutation
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

BOUND = 120
NOTIFY = 0x01
FULL, BRIEF = Feature.CLUSTERMAP_CHANGE_NOTIFICATION, Feature.CLUSTERMAP_CHANGE_NOTIFICATION_BRIEF


def push(key=b"default", extras=struct.pack(">qq", 1, 7), value=b"", opcode=NOTIFY, opaque=9, datatype=None):
    return m.encode(m.Request(opcode=opcode, magic=0x82, opaque=opaque, key=key, extras=extras, value=value,
                              datatype=(1 if value else 0) if datatype is None else datatype))


def cluster_model(events, seed=5, items=6000, vbuckets=16):
    return P.server_from_options(vbuckets=vbuckets, items=items, seed=seed, nodes=3, replicas=1,
                                 events=tuple(events), scenarios=P.Scenarios(failover_loss=12))


def late_model(seed: int, failover: int | None = None):
    """A 3-node cluster whose rebalance moves every vbucket and fires only after more stream
    frames than any two nodes hold, so every node's connection is streaming by then (the
    first connection cannot race past it alone); optionally a failover of node `failover`
    300 frames later."""
    bucket = Bucket("default", 16, 6000, seed)
    probe = Cluster(bucket, 3, 1, seed)      # the same seeded placement as the real one
    per_node = sorted(sum(bucket.vbuckets[vb].high_seqno for vb in probe.active_vbuckets(n)) for n in range(3))
    at = per_node[1] + per_node[2] + 100
    assert at + 600 < sum(per_node)
    events = [Event(at, "rebalance")] + ([Event(at + 300, "failover", failover)] if failover is not None else [])
    cluster = Cluster(bucket, 3, 1, seed, rebalance_share=1.0, events=tuple(events))
    return P.ServerModel([bucket], None, P.Scenarios(failover_loss=12), seed, cluster)


def feed(consumer: Consumer, data: bytes, byte_at_a_time: bool) -> list:
    if not byte_at_a_time:
        return consumer.feed(data, 1.0)
    return [e for i in range(len(data)) for e in consumer.feed(data[i:i + 1], 1.0)]


def answers(out: list[bytes]) -> list[tuple[int, int, int, int]]:
    """(magic, opcode, opaque, status) of the frames a consumer sent."""
    return [(f.magic, f.opcode, f.opaque, f.vbucket_or_status)
            for data in out for f in [m.parse_frame(data, 0, len(data))]]


# --------------------------------------------------------------------------- consumer, sans-IO

def test_hello_asks_duplex_and_the_notification():
    c = Consumer(ConsumerConfig(bucket="default", name="n"))
    c.start(0.0)
    hello = m.decode_bytes(c.outgoing()[0])
    assert Feature.DUPLEX in hello.features and FULL in hello.features and BRIEF not in hello.features


@pytest.mark.parametrize("byte_at_a_time", [False, True])
def test_consumer_answers_0x83_and_reports_the_pushed_config(byte_at_a_time):
    c = Consumer(ConsumerConfig(bucket="default", name="n"))
    c.start(0.0)
    c.outgoing()
    body = b'{"rev":7,"revEpoch":1}'
    # whole, then followed by the next frame (an old server's 4-byte rev, a brief push)
    data = push(value=body, opaque=41) + push(extras=struct.pack(">I", 8), opaque=42)
    events = feed(c, data, byte_at_a_time)
    assert events == [ConfigPushed(1, 7, body), ConfigPushed(0, 8, b"")]
    assert answers(c.outgoing()) == [(0x83, NOTIFY, 41, 0), (0x83, NOTIFY, 42, 0)]


@pytest.mark.parametrize("frame, why", [
    (push(key=b"other"), "for bucket 'other'"),
    (push(extras=b"\x00" * 8), "8 bytes of extras"),
    (push(extras=b""), "0 bytes of extras"),
    (push(value=b"\xff\xff\xff\xff\x0f" + b"x" * 8, datatype=3), "announces more than"),
    (push(value=b"\x05not snappy at all", datatype=3), "does not decompress"),
    (push(value=b" " * (MAX_PUSHED_CONFIG + 1)), "limit"),
    (push(opcode=0x02), "server request 0x02"),
])
def test_hostile_pushes_are_answered_and_ignored(frame, why):
    c = Consumer(ConsumerConfig(bucket="default", name="n"))
    c.start(0.0)
    c.outgoing()
    events = c.feed(frame, 1.0)
    assert len(events) == 1 and type(events[0]) is PushIgnored and why in events[0].reason, events
    assert answers(c.outgoing()) == [(0x83, frame[1], 9, 0)]


def test_snappy_pushed_config_is_decompressed():
    import cramjam
    body = b'{"rev":3}'
    c = Consumer(ConsumerConfig(bucket="default", name="n"))
    assert c.feed(push(value=bytes(cramjam.snappy.compress_raw(body)), datatype=3), 1.0) == [ConfigPushed(1, 7, body)]


def _wire(cons: Consumer, prod, now=1.0, rounds=200, sent=None) -> list:
    """Move bytes both ways until neither side has anything to say; the consumer's events
    (and its frames appended to `sent`)."""
    events = []
    for _ in range(rounds):
        moved = False
        for fr in cons.outgoing():
            if sent is not None:
                sent.append(fr)
            prod.receive(fr, now)
            moved = True
        data = b"".join(bytes(x) for x in prod.pull(now))
        if data:
            events += cons.feed(data, now)
            moved = True
        if not moved:
            break
    return events


def test_producer_pushes_on_rebalance_and_the_consumer_applies_it():
    model = cluster_model((), items=200, vbuckets=8)
    for node in range(3):
        model.bind_node(node, "127.0.0.1", 11210 + node)
    cl = model.cluster
    first = cl.render(0)
    mine = cl.active_vbuckets(0)
    cons = Consumer(ConsumerConfig(bucket="default", name="n", vbuckets=mine, to="forever"))
    prod = model.connect(0.0, 0)
    cons.start(0.0)
    _wire(cons, prod)
    assert cons.handshake.streaming and notify_mode(prod.features) == "full"
    change = cl.rebalance(share=0.5)
    moved = [mv.vb for mv in change.moves if mv.old == 0]
    assert moved
    model.apply_changes([change])
    sent: list[bytes] = []
    events = _wire(cons, prod, sent=sent)
    pushed = [e for e in events if type(e) is ConfigPushed]
    assert pushed == [ConfigPushed(cl.rev_epoch, cl.rev, cl.render(0))]
    # the map comes before the stream ends it explains
    ends = [i for i, e in enumerate(events) if type(e) is StreamEnded]
    assert ends and events.index(pushed[0]) < min(ends)
    assert {e.vbucket for e in events if type(e) is StreamEnded and e.reason == StreamEndReason.STATE_CHANGED} \
        == set(moved)
    # the 0x83 answer went out, and the producer took it as nothing to answer
    assert cl.pushes == 1
    assert [a for a in answers(sent) if a[0] == 0x83] == [(0x83, NOTIFY, NOTIFY_OPAQUE_BASE + 1, 0)]
    assert prod.closed is None and prod.pull(1.0) == []
    # applying it, as the cluster session does, names the new owners
    r = Router(None)
    assert r.apply(first, "127.0.0.1") and r.apply(pushed[0].raw, "127.0.0.1")
    for mv in change.moves:
        new = cl.nodes[mv.new]
        assert r.owner(mv.vb) == f"127.0.0.1:{new.port}"


@pytest.mark.parametrize("asked, granted, mode", [
    ((FULL,), {FULL}, "full"), ((BRIEF,), {BRIEF}, "brief"), ((FULL, BRIEF), {BRIEF}, "brief"), ((), set(), None)])
def test_producer_grants_the_notification_with_duplex(asked, granted, mode):
    model = cluster_model((), items=10, vbuckets=4)
    prod = model.connect(0.0, 0)
    for duplex in (True, False):
        feats = (*asked, Feature.DUPLEX) if duplex else asked
        prod.receive(m.encode(m.Hello(agent=b"t", features=feats, opaque=1)), 0.0)
        rsp = m.decode_bytes(b"".join(prod.pull(0.0)))
        assert {f for f in rsp.features if f in (FULL, BRIEF)} == granted
        assert notify_mode(prod.features) == (mode if duplex else None)


def test_producer_sends_a_brief_push_without_a_body():
    model = cluster_model((), items=10, vbuckets=4)
    model.bind_node(0, "127.0.0.1", 11210)
    prod = model.connect(0.0, 0)
    for msg in (m.Hello(agent=b"t", features=(Feature.DUPLEX, BRIEF, Feature.JSON)),
                m.SelectBucket(bucket=b"default")):
        prod.receive(m.encode(msg), 0.0)
    prod.pull(0.0)
    model.apply_changes([model.cluster.add_node()])
    frames = b"".join(prod.pull(0.0))
    f = m.parse_frame(frames, 0, len(frames))
    assert (f.magic, f.opcode, f.key, f.value) == (0x82, NOTIFY, b"default", b"")
    assert struct.unpack(">qq", f.extras) == (model.cluster.rev_epoch, model.cluster.rev)
    # the client's 0x83 is no error and gets no answer
    prod.receive(m.encode(m.Response(opcode=NOTIFY, opaque=f.opaque, magic=0x83)), 0.0)
    assert prod.pull(0.0) == [] and prod.closed is None


def test_columnar_and_messages_name_the_notification_and_its_answer():
    from dcptool.protocol.dcp.wire.columnar import decode_batch, to_rows
    data = push(value=b'{"rev":2}') + m.encode(m.Response(opcode=NOTIFY, opaque=9, magic=0x83)) \
        + m.encode(m.Request(opcode=0x01, key=b"k"))
    offsets, lengths, used, err = scan(data, 1 << 20)
    assert err is None and used == len(data)
    want = ["clustermap_change_notification", "clustermap_change_notification", "unknown_0x01"]
    assert [r["op"] for r in to_rows(decode_batch(data, offsets, lengths))] == want
    assert [m.to_row(m.decode_bytes(data[o:o + n]))["op"] for o, n in zip(offsets.tolist(), lengths.tolist())] == want


# --------------------------------------------------------------------------- cluster session, sans-IO

def _session_with_map(model):
    for node in range(3):
        model.bind_node(node, "127.0.0.1", 11210 + node)
    cfg = ConsumerConfig(bucket="default", name="n")
    s = ClusterSession(cfg, [("127.0.0.1", 11210)], config_poll=60)
    s._mode = "cluster"
    s._wake = asyncio.Event()
    assert s.router.apply(model.cluster.render(0), "127.0.0.1")
    cons = Consumer(dataclasses.replace(cfg, fetch_config=True))
    return s, _Link(1, "127.0.0.1", 11210, cons, {})


def test_session_applies_a_push_fetches_a_brief_one_and_ignores_a_bad_one():
    model = cluster_model((), items=10, vbuckets=4)
    s, link = _session_with_map(model)
    key = s.router.key
    fwd: list = []
    s._pushed(link, ConfigPushed(key[0], key[1] + 5, b"{not json"), fwd)
    assert [type(e) for e in fwd] == [PushIgnored] and "malformed" in fwd[0].reason and s.router.key == key
    fwd.clear()
    s._pushed(link, ConfigPushed(key[0], key[1], b""), fwd)          # brief, not newer: nothing to fetch
    assert link.consumer.outgoing() == [] and not fwd
    s._pushed(link, ConfigPushed(key[0], key[1] + 1, b""), fwd)      # brief, newer: fetched at once
    assert [(a, o) for a, o, _, _ in answers(link.consumer.outgoing())] == [(0x80, 0xB5)]
    change = model.cluster.rebalance(share=0.5)
    s._pushed(link, ConfigPushed(model.cluster.rev_epoch, model.cluster.rev, model.cluster.render(0)), fwd)
    assert [type(e) for e in fwd] == [MapApplied] and s.router.key == (model.cluster.rev_epoch, model.cluster.rev)
    assert all(s.router.owner(mv.vb) == f"127.0.0.1:{11210 + mv.new}" for mv in change.moves)


# --------------------------------------------------------------------------- against serve dcp

def stream(url, *args):
    res = subprocess.run([DCPTOOL, "stream", url, "--timeout", "5s", "--format", "jsonl", "--raw", *args],
                         capture_output=True, text=True, timeout=BOUND)
    return res, [orjson.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]


def test_rebalance_moves_streams_by_notification_without_any_poll():
    model = late_model(seed=5)
    with ThreadedServer(model) as srv:
        res, rows = stream(f"couchbase://{srv.host}:{srv.port}/default", "--config-poll", "60s")
    assert res.returncode == 0, res.stderr
    assert survivors(rows) == final_state(model)
    moved = {mv.vb for mv in model.cluster.changes[0].moves}
    assert any(r["op"] == "stream_end" and r["stream_end_reason"] == 2 and r["vbucket"] in moved for r in rows)
    pushes = [r for r in rows if r["magic"] == 0x82]
    assert pushes and {r["op"] for r in pushes} == {"clustermap_change_notification"}
    answered = {(r["conn"], r["opaque"]) for r in rows if r["magic"] == 0x83 and r["direction"] == "out"}
    assert {(r["conn"], r["opaque"]) for r in pushes} == answered
    # no connection asked for the map after its bootstrap: the pushes alone moved the streams
    asks = [r["conn"] for r in rows if r["op"] == "get_cluster_config" and r["direction"] == "out"]
    assert sorted(asks) == sorted(set(asks)) and set(asks) == {r["conn"] for r in rows}


def test_capture_replay_topology_shows_the_notifications(tmp_path):
    model = late_model(seed=9, failover=1)
    out = tmp_path / "cap"
    with ThreadedServer(model) as srv:
        res = subprocess.run([DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", str(out),
                              "--quiet", "--timeout", "5s", "--config-poll", "60s"],
                             capture_output=True, text=True, timeout=BOUND)
    assert res.returncode == 0, res.stderr
    files = find_captures([str(out)])
    result = local.replay_local(files)
    topo = result.table("topology").to_pylist()
    via = {(t["rev_epoch"], t["rev"]): t["via"] for t in topo}
    cl = model.cluster
    assert [ch.kind for ch in cl.changes] == ["rebalance", "failover"]
    assert via[(cl.rev_epoch, 1)] == "get_cluster_config"
    assert via[(cl.rev_epoch, cl.changes[0].rev)] == "clustermap_notification"
    # the failover's map reaches whichever connection still streams first: pushed to it, or
    # asked for by a connection that saw its node drop before the push came
    assert via[(cl.rev_epoch, cl.changes[1].rev)] in ("clustermap_notification", "get_cluster_config")
    # the rows of the last revision are the producer's final map
    last = parse(cl.render(0), "127.0.0.1")
    for t in topo:
        if t["rev"] == cl.rev:
            assert t["active"] == last.server_list[last.vbucket_map[t["vbucket"]][0]]
    got: dict[int, dict[str, int]] = {}
    for d in result.table("documents").to_pylist():
        key = d["key"].decode() if isinstance(d["key"], bytes) else d["key"]
        got.setdefault(d["vbucket"], {})[key] = d["by_seqno"]
    assert got == final_state(model)
    frames = read_capture_table(files, ["conn", "direction", "magic", "op", "opaque"]).to_pylist()
    pushes = {(r["conn"], r["opaque"]) for r in frames if r["magic"] == 0x82 and r["direction"] == "in"}
    assert pushes and pushes == {(r["conn"], r["opaque"]) for r in frames if r["magic"] == 0x83}
    assert {r["op"] for r in frames if r["magic"] in (0x82, 0x83)} == {"clustermap_change_notification"}


def test_brief_notifications_fetch_the_map(monkeypatch):
    monkeypatch.setattr(dcp_consumer, "NOTIFY_FEATURES", (BRIEF,))   # what Consumer.start asks HELLO for
    model = late_model(seed=3)
    frames: list[tuple[int, bytes, str]] = []
    events: list = []

    class Tap:
        conn = 0

        def attach(self, conn, consumer, node):
            self.conn = conn

        def on_received(self, buf, offsets, lengths, ts_ns, mono_ns):
            frames.extend((self.conn, bytes(buf[o:o + n]), "in") for o, n in zip(list(offsets), list(lengths)))

        def on_sent(self, frame, ts_ns, mono_ns):
            frames.append((self.conn, bytes(frame), "out"))

    with ThreadedServer(model) as srv:
        s = ClusterSession(ConsumerConfig(bucket="default", name="brief", timeout=5.0),
                           [(srv.host, srv.port)], tap=Tap(), on_events=events.extend, config_poll=60)
        result = asyncio.run(asyncio.wait_for(s.run(), BOUND))
    highs = {vb.vbid: vb.high_seqno for vb in model.buckets["default"].vbuckets}
    assert {vb: st.last_seqno for vb, st in result.states.items()} == highs and not result.unserved
    pushed = [(c, m.parse_frame(f, 0, len(f))) for c, f, d in frames if d == "in" and f[0] == 0x82]
    assert pushed and all(p.value == b"" for _, p in pushed)
    assert any(type(e) is MapApplied and e.rev == model.cluster.rev for e in events)
    # each push is answered, and the map fetched on that connection after it
    for conn, p in pushed:
        later = [m.parse_frame(f, 0, len(f)) for c, f, d in frames[frames.index((conn, p.raw, "in")):]
                 if c == conn and d == "out"]
        assert (later[0].magic, later[0].opaque) == (0x83, p.opaque)
    assert any(f[1] == 0xB5 for c, f, d in frames[frames.index((pushed[0][0], pushed[0][1].raw, "in")):]
               if d == "out")


def test_producer_that_never_pushes_still_moves_streams_by_polling(monkeypatch):
    monkeypatch.setattr(P, "GRANTED_FEATURES", tuple(f for f in P.GRANTED_FEATURES if f not in (FULL, BRIEF)))
    model = late_model(seed=7, failover=2)
    with ThreadedServer(model) as srv:
        res, rows = stream(f"couchbase://{srv.host}:{srv.port}/default")
    assert res.returncode == 0, res.stderr
    assert survivors(rows) == final_state(model)
    assert not any(r["magic"] in (0x82, 0x83) for r in rows)
    # streams that ended "state changed" were reopened on another node, after a connection
    # asked for the map again (beyond its bootstrap)
    ended = {(r["vbucket"], r["node"]) for r in rows if r["op"] == "stream_end" and r["stream_end_reason"] == 2}
    assert ended
    reopened = {(r["vbucket"], r["node"]) for r in rows
                if r["op"] == "stream_req" and r["direction"] == "in" and r["status"] == 0}
    assert all(any(v == vb and n != node for v, n in reopened) for vb, node in ended)
    asks = [r["conn"] for r in rows if r["op"] == "get_cluster_config" and r["direction"] == "out"]
    assert len(asks) > len(set(asks))


def test_single_node_with_hostile_pushes_keeps_streaming():
    end = lambda opaque: m.encode(m.StreamEnd(vbucket=0, opaque=opaque, reason=0))  # noqa: E731
    bad = [push(key=b"\x1b[31mevil"), push(value=b"{not json"), push(extras=b"\x01"), push(opcode=0x7f)]
    # the mutation after them carries the stream's opaque
    inject = [*bad, lambda opaque: mutation(0, 4, b"after", opaque), end]
    with HostileDcp(items=3, inject=inject) as srv:
        res, rows = stream(srv.url, "--vbuckets", "0")
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "\x1b" not in res.stderr
    assert [r["by_seqno"] for r in rows if r["op"] == "mutation"] == [1, 2, 3, 4]
    assert sum(1 for r in rows if r["magic"] == 0x83) == len(bad)
    assert res.stderr.count("server request ignored") == 3     # the bad JSON is not looked at on one node
