"""`serve dcp --nodes N`: the cluster map over GET_CLUSTER_CONFIG, NOT_MY_VBUCKET with the
config, scripted rebalance and failover, and the kv_engine fidelity fixes (snapshot start,
DCP_CONTROL keys, bootstrap before auth). Raw frames over 127.0.0.1, bounded in time."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import selectors
import socket
import subprocess
import time

import cramjam
import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.cluster import Event
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.cluster_config import parse
from dcptool.protocol.dcp.wire.constants import Feature, Status, StreamEndReason
from dcptool.protocol.dcp.wire.frames import FrameParser
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

INF = 0xFFFFFFFFFFFFFFFF
DEADLINE = 20.0


class Raw:
    """A raw memcached-binary client: send messages, read decoded ones, bounded in time."""

    def __init__(self, addr: tuple[str, int]):
        self.addr = addr
        self.sock = socket.create_connection(addr, timeout=DEADLINE)
        self.parser = FrameParser()
        self.inbox: list = []
        self.opaque = 100
        self.eof = False
        self.wire: dict[int, bytes] = {}     # id(message) -> the exact bytes received

    def send(self, msg) -> int:
        self.opaque += 1
        self.sock.sendall(m.encode(dataclasses.replace(msg, opaque=self.opaque)))
        return self.opaque

    def fill(self) -> None:
        data = self.sock.recv(1 << 20)
        if not data:
            self.eof = True
            raise ConnectionError("closed by the server")
        for f in self.parser.feed(data):
            self.inbox.append(m.decode(f))
            self.wire[id(self.inbox[-1])] = f.raw

    def call(self, msg):
        op = self.send(msg)
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            for i, x in enumerate(self.inbox):
                if x.IS_RESPONSE and x.opaque == op:
                    return self.inbox.pop(i)
            self.fill()
        raise TimeoutError("no answer")

    def dcp(self, name: bytes, features=(), controls=()) -> "Raw":
        if features:
            self.call(m.Hello(agent=b"test", features=tuple(features)))
        assert self.call(m.SelectBucket(bucket=b"default")).status == 0
        assert self.call(m.DcpOpen(name=name, flags=1)).status == 0
        for k, v in controls:
            assert self.call(m.Control(key=k, value=v)).status == 0, k
        return self

    def config(self):
        rsp = self.call(m.Request(opcode=0xB5))
        assert rsp.status == 0
        return parse(rsp.value, self.addr[0]), rsp.value

    def close(self):
        self.sock.close()


class Tracker:
    """Per-vbucket consumer state out of stream frames on any connection."""

    def __init__(self):
        self.uuid: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.snap: dict[int, tuple[int, int]] = {}
        self.ends: dict[int, int] = {}
        self.markers: dict[int, list] = {}
        self.seqnos: dict[int, list[int]] = {}

    def take(self, msg) -> None:
        vb = getattr(msg, "vbucket", None)
        if isinstance(msg, m.SnapshotMarker):
            self.snap[vb] = (msg.snap_start, msg.snap_end)
            self.markers.setdefault(vb, []).append((msg.snap_start, msg.snap_end))
        elif isinstance(msg, (m.Mutation, m.Deletion, m.Expiration)):
            self.last[vb] = msg.by_seqno
            self.seqnos.setdefault(vb, []).append(msg.by_seqno)
        elif isinstance(msg, m.StreamEnd):
            self.ends[vb] = msg.reason


def pump(conns: list[Raw], tracker: Tracker, until, deadline: float = DEADLINE) -> None:
    """Read every connection into the tracker until `until()` or the deadline (a failure)."""
    sel = selectors.DefaultSelector()
    for c in conns:
        sel.register(c.sock, selectors.EVENT_READ, c)
    end = time.monotonic() + deadline

    def drain(c):
        keep = []
        for x in c.inbox:
            if x.IS_RESPONSE:
                keep.append(x)
            else:
                tracker.take(x)
        c.inbox = keep

    for c in conns:
        drain(c)
    try:
        while not until():
            assert time.monotonic() < end, "timed out waiting for the producer"
            for key, _ in sel.select(0.2):
                c = key.data
                try:
                    c.fill()
                except ConnectionError:
                    sel.unregister(c.sock)
                drain(c)
    finally:
        sel.close()


def stream_all(conns: dict[int, Raw], cfg, tracker: Tracker, end=INF) -> None:
    for node, c in conns.items():
        for vb in cfg.active_vbuckets(node):
            rsp = c.call(m.StreamRequest(vbucket=vb, start_seqno=0, end_seqno=end))
            assert rsp.status == 0, (vb, rsp)
            tracker.uuid[vb] = rsp.failover_log[0][0]


@pytest.fixture
def cli_cluster():
    """`dcptool serve dcp --nodes 3 --replicas 1` with a user: its node addresses."""
    env = dict(os.environ, DCPTOOL_PASSWORD="s3cret")
    proc = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", "--nodes", "3", "--replicas", "1",
                             "--vbuckets", "16", "--items", "400", "--seed", "3", "--user", "alice"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = json.loads(proc.stdout.readline())
        nodes = [(h, int(p)) for h, _, p in (a.rpartition(":") for a in line["nodes"])]
        assert line["listening"] == line["nodes"][0]
        yield nodes
    finally:
        proc.terminate()
        proc.wait(10)


def test_cli_cluster_configs_and_not_my_vbucket(cli_cluster):
    nodes = cli_cluster
    assert len(nodes) == 3 and len({p for _, p in nodes}) == 3
    configs = []
    for i, addr in enumerate(nodes):
        c = Raw(addr)
        # before authentication: the error map and the (cluster part of the) config
        emap = c.call(m.GetErrorMap(version=2))
        assert emap.status == 0 and json.loads(emap.value)["errors"]["7"]["name"] == "NOT_MY_VBUCKET"
        pre = c.call(m.Request(opcode=0xB5))
        assert pre.status == 0 and json.loads(pre.value)["nodesExt"]
        assert c.call(m.DcpOpen(name=b"x", flags=1)).status == Status.EACCESS   # the rest needs auth
        assert c.call(m.SaslAuth(mechanism=b"PLAIN", data=b"\0alice\0s3cret")).status == 0
        assert c.call(m.SelectBucket(bucket=b"default")).status == 0
        cfg, raw = c.config()
        assert [e.get("thisNode", False) for e in json.loads(raw)["nodesExt"]] == [j == i for j in range(3)]
        configs.append((c, cfg))
    revs = {cfg.key for _, cfg in configs}
    assert len(revs) == 1
    cfg = configs[0][1]
    assert [(n.hostname, n.kv) for n in cfg.kv_nodes()] == nodes
    assert all(cfg == other for _, other in configs)
    assert cfg.num_vbuckets == 16 and cfg.num_replicas == 1
    for vb in range(16):
        row = cfg.vbucket_map[vb]
        assert 0 <= row[0] < 3 and row[1] not in (-1, row[0])     # one active node, one other replica
    assert sorted(vb for i in range(3) for vb in cfg.active_vbuckets(i)) == list(range(16))
    # the wrong node: NOT_MY_VBUCKET with the config; the right node streams
    conn0 = configs[0][0]
    assert conn0.call(m.DcpOpen(name=b"n0", flags=1)).status == 0
    wrong = next(vb for vb in range(16) if cfg.active_index(vb) != 0)
    right = cfg.active_vbuckets(0)[0]
    rsp = conn0.call(m.StreamRequest(vbucket=wrong, start_seqno=0, end_seqno=INF))
    assert rsp.status == Status.NOT_MY_VBUCKET and parse(rsp.value, nodes[0][0]) == cfg
    rsp = conn0.call(m.GetFailoverLog(vbucket=wrong))
    assert rsp.status == Status.NOT_MY_VBUCKET and parse(rsp.value, nodes[0][0]) == cfg
    assert conn0.call(m.StreamRequest(vbucket=right, start_seqno=0, end_seqno=INF)).status == 0
    for c, _ in configs:
        c.close()


def _cluster(items, vbuckets, events, replicas=1, loss=10):
    model = P.server_from_options(vbuckets=vbuckets, items=items, seed=11, nodes=3, replicas=replicas,
                                  events=events, scenarios=P.Scenarios(failover_loss=loss))
    return model, ThreadedServer(model)


@contextlib.contextmanager
def _streamed_cluster(event, loss=10, items=600, nvb=8):
    """A 3-node cluster whose one scripted event fires just after every stream sent its disk
    snapshot, with a connection per node that has streamed every vbucket to its high seqno.
    Yields (model, server, connections by node, the config before, the tracker, high seqnos)."""
    model, srv = _cluster(items, nvb, (Event(items + nvb + 5, *event),), loss=loss)
    with srv:
        conns = {i: Raw(srv.addresses[i]).dcp(b"c%d" % i) for i in range(3)}
        cfg, _ = conns[0].config()
        t = Tracker()
        stream_all(conns, cfg, t)
        highs = {vb.vbid: vb.high_seqno for vb in model.buckets["default"].vbuckets}
        pump(list(conns.values()), t, lambda: all(t.last.get(vb, 0) == h for vb, h in highs.items()))
        try:
            yield model, srv, conns, cfg, t, highs
        finally:
            for c in conns.values():
                c.close()


def _trigger(srv: ThreadedServer, cfg, node: int, frames_needed: int) -> None:
    """Serve more stream frames (a second connection re-reading vbuckets of `node`)."""
    c = Raw(srv.addresses[node]).dcp(b"trigger")
    t = Tracker()
    vbs = cfg.active_vbuckets(node)
    for vb in vbs:
        assert c.call(m.StreamRequest(vbucket=vb, start_seqno=0, end_seqno=INF)).status == 0
    pump([c], t, lambda: sum(len(v) for v in t.seqnos.values()) >= frames_needed)
    c.close()


def test_rebalance_ends_moved_streams_and_new_owner_continues_without_rollback():
    with _streamed_cluster(("rebalance",)) as (model, srv, conns, cfg, t, highs):
        assert model.cluster.rev == cfg.rev          # nothing happened yet
        _trigger(srv, cfg, 0, 10)
        change = model.cluster.changes[0]
        moved = {mv.vb: mv for mv in change.moves}
        assert change.kind == "rebalance" and moved
        pump(list(conns.values()), t, lambda: set(t.ends) >= set(moved))
        assert all(t.ends[vb] == StreamEndReason.STATE_CHANGED for vb in moved)
        assert not set(t.ends) - set(moved)                # other streams keep going
        new_cfg, _ = conns[1].config()
        assert new_cfg.rev == cfg.rev + 1
        for vb, mv in moved.items():
            assert cfg.active_index(vb) == mv.old and new_cfg.active_index(vb) == mv.new != mv.old
            # the old owner refuses it now, with the new map
            rsp = conns[mv.old].call(m.StreamRequest(vbucket=vb, start_seqno=0, end_seqno=INF))
            assert rsp.status == Status.NOT_MY_VBUCKET and parse(rsp.value, "127.0.0.1").key == new_cfg.key
            # the new owner: same data, one more failover entry at the high seqno, no rollback
            new = Raw(srv.addresses[mv.new]).dcp(b"resume%d" % vb)
            ss, se = t.snap[vb]
            rsp = new.call(m.StreamRequest(vbucket=vb, start_seqno=t.last[vb], end_seqno=INF,
                                           vbucket_uuid=t.uuid[vb], snap_start=ss, snap_end=se))
            assert rsp.status == 0, rsp
            assert rsp.failover_log[0][1] == highs[vb] == mv.seqno and rsp.failover_log[1][0] == t.uuid[vb]
            new.close()


def test_failover_promotes_lagging_replicas_and_consumers_roll_back():
    loss = 7
    with _streamed_cluster(("failover", 2), loss=loss) as (model, srv, conns, cfg, t, highs):
        lost_vbs = cfg.active_vbuckets(2)
        assert lost_vbs
        _trigger(srv, cfg, 0, 10)
        pump([conns[2]], t, lambda: conns[2].eof)            # node 2 stops answering
        new_cfg, _ = conns[0].config()
        assert new_cfg.rev == cfg.rev + 1 and len(new_cfg.kv_nodes()) == 2
        assert srv.addresses[2][1] not in [n.kv for n in new_cfg.kv_nodes()]
        for vb in lost_vbs:
            node = new_cfg.active_node(vb)
            assert node is not None and node.kv == srv.addresses[cfg.vbucket_map[vb][1]][1]
            c = Raw((node.hostname, node.kv)).dcp(b"after%d" % vb)
            ss, se = t.snap[vb]
            rsp = c.call(m.StreamRequest(vbucket=vb, start_seqno=t.last[vb], end_seqno=INF,
                                         vbucket_uuid=t.uuid[vb], snap_start=ss, snap_end=se))
            assert rsp.status == Status.ROLLBACK and rsp.rollback_seqno == highs[vb] - loss
            log = c.call(m.GetFailoverLog(vbucket=vb)).failover_log
            assert log[0][1] == highs[vb] - loss and log[1][0] == t.uuid[vb]
            c.close()
        # the failed node refuses service
        dead = Raw(srv.addresses[2])
        with pytest.raises(ConnectionError):
            dead.call(m.Request(opcode=0xB5))
        dead.close()


def test_add_node_then_rebalance_fills_it():
    model = P.server_from_options(vbuckets=12, items=120, seed=5, nodes=2, replicas=1,
                                  events=(Event(1, "add-node"), Event(2, "rebalance")))
    cl = model.cluster
    assert len(cl.nodes) == 3 and not cl.nodes[2].joined and len(cl.config().kv_nodes()) == 2
    cl.fire_due(1, 10)
    assert cl.nodes[2].joined and len(cl.config().kv_nodes()) == 3 and cl.active_vbuckets(2) == []
    ch = cl.fire_due(2, 10)[0]
    assert {mv.new for mv in ch.moves} == {2} and len(cl.active_vbuckets(2)) == 4
    assert cl.rev == 3
    # deterministic with the seed
    again = P.server_from_options(vbuckets=12, items=120, seed=5, nodes=2, replicas=1,
                                  events=(Event(1, "add-node"), Event(2, "rebalance"))).cluster
    again.fire_due(2, 10)
    assert again.vbmap == cl.vbmap


# --------------------------------------------------------------------------- fidelity

@pytest.fixture
def single():
    model = P.server_from_options(vbuckets=4, items=400, seed=2)
    with ThreadedServer(model) as srv:
        yield model, srv


def test_first_marker_starts_at_the_requested_snapshot_start(single):
    model, srv = single
    vb = model.buckets["default"].vbuckets[0]
    c = Raw((srv.host, srv.port)).dcp(b"snap")
    t = Tracker()
    rsp = c.call(m.StreamRequest(vbucket=0, start_seqno=20, end_seqno=INF, vbucket_uuid=vb.uuid,
                                 snap_start=10, snap_end=40))
    assert rsp.status == 0
    vb1 = model.buckets["default"].vbuckets[1]
    rsp = c.call(m.StreamRequest(vbucket=1, start_seqno=20, end_seqno=INF, vbucket_uuid=vb1.uuid,
                                 snap_start=20, snap_end=40))
    assert rsp.status == 0
    pump([c], t, lambda: 0 in t.markers and 1 in t.markers)
    assert t.markers[0][0][0] == 10                  # min(requested snap_start, start)
    assert t.markers[1][0][0] == 20                  # not inside a snapshot: the start
    assert t.seqnos[0][0] == 21
    c.close()


ACCEPTED = [(b"enable_noop", b"true"), (b"set_noop_interval", b"60"), (b"set_priority", b"high"),
            (b"enable_expiry_opcode", b"true"), (b"connection_buffer_size", b"1048576"),
            (b"send_stream_end_on_client_close_stream", b"true"), (b"supports_cursor_dropping_vulcan", b"true"),
            (b"supports_hifi_MFU", b"true"), (b"enable_out_of_order_snapshots", b"true"),
            (b"enable_out_of_order_snapshots", b"true_with_seqno_advanced"),
            (b"flatbuffers_system_events", b"true"), (b"enable_sync_writes", b"true"),
            (b"v7_dcp_status_codes", b"true"), (b"backfill_order", b"round-robin"),
            (b"max_marker_version", b"2.2"), (b"consumer_name", b"me")]


def test_controls_real_clients_send(single):
    _, srv = single
    c = Raw((srv.host, srv.port))
    c.call(m.Hello(agent=b"t", features=(Feature.COLLECTIONS, Feature.JSON)))
    c.dcp(b"controls")
    got = {(k, v): c.call(m.Control(key=k, value=v)).status for k, v in ACCEPTED}
    assert got == {kv: 0 for kv in ACCEPTED}
    refused = {k: c.call(m.Control(key=k, value=b"true")).status
               for k in (b"no_such_key", b"force_value_compression", b"include_deleted_user_xattrs",
                         b"stream_buffer_size", b"change_streams")}
    assert refused == {b"no_such_key": Status.EINVAL, b"force_value_compression": Status.EINVAL,   # no snappy
                       b"include_deleted_user_xattrs": Status.EINVAL,      # not asked for in DCP_OPEN
                       b"stream_buffer_size": Status.NOT_SUPPORTED, b"change_streams": Status.NOT_SUPPORTED}
    assert c.call(m.Control(key=b"enable_out_of_order_snapshots", value=b"maybe")).status == Status.EINVAL
    c.close()
    c = Raw((srv.host, srv.port))
    c.call(m.SelectBucket(bucket=b"default"))
    assert c.call(m.DcpOpen(name=b"xa", flags=1 | 0x100)).status == 0
    assert c.call(m.Control(key=b"include_deleted_user_xattrs", value=b"true")).status == 0
    c.close()


def test_force_value_compression_sends_snappy_values(single):
    model, srv = single
    vb = model.buckets["default"].vbuckets[0]
    c = Raw((srv.host, srv.port))
    c.call(m.Hello(agent=b"t", features=(Feature.SNAPPY, Feature.JSON)))
    c.dcp(b"snappy", controls=[(b"force_value_compression", b"true")])
    got = []
    assert c.call(m.StreamRequest(vbucket=0, start_seqno=0, end_seqno=vb.high_seqno)).status == 0
    end = time.monotonic() + DEADLINE
    while not any(isinstance(x, m.StreamEnd) for x in c.inbox):
        assert time.monotonic() < end
        c.fill()
    got = [x for x in c.inbox if isinstance(x, m.Mutation)]
    assert len(got) == vb.high_seqno
    for x in got:
        assert x.datatype & 0x02 and x.datatype & 0x01
        raw = bytes(cramjam.snappy.decompress_raw(x.value))
        assert raw == vb.disk_item(x.by_seqno).value
    c.close()


def test_backfill_order_sequential_serves_one_stream_at_a_time(single):
    model, srv = single
    c = Raw((srv.host, srv.port)).dcp(b"seq", controls=[(b"backfill_order", b"sequential")])
    vbs = model.buckets["default"].vbuckets
    for vb in (0, 1):
        assert c.call(m.StreamRequest(vbucket=vb, start_seqno=0, end_seqno=vbs[vb].high_seqno)).status == 0
    order = []
    end = time.monotonic() + DEADLINE
    while sum(isinstance(x, m.StreamEnd) for x in c.inbox) < 2:
        assert time.monotonic() < end
        c.fill()
    order = [x.vbucket for x in c.inbox if isinstance(x, m.Mutation)]
    assert order == [0] * vbs[0].high_seqno + [1] * vbs[1].high_seqno
    c.close()


@pytest.mark.integration
def test_cluster_frames_decode_in_tshark():
    """GET_ERROR_MAP, GET_CLUSTER_CONFIG and NOT_MY_VBUCKET answers decode in Wireshark's
    couchbase dissector as in ours."""
    from tests.support.tshark_util import compare, require_tshark, tshark_frames
    require_tshark()
    model = P.server_from_options(vbuckets=8, items=40, seed=4, nodes=2)
    with ThreadedServer(model) as srv:
        c = Raw(srv.addresses[0])
        sent = [m.Hello(agent=b"t", features=(Feature.JSON,)), m.GetErrorMap(version=2), m.Request(opcode=0xB5),
                m.SelectBucket(bucket=b"default"), m.Request(opcode=0xB5), m.DcpOpen(name=b"ts", flags=1)]
        frames = []
        for msg in sent:
            frames.append((False, m.encode(dataclasses.replace(msg, opaque=c.opaque + 1))))
            rsp = c.call(msg)
            frames.append((True, c.wire[id(rsp)]))
        cfg = model.cluster.config()
        wrong = next(vb for vb in range(8) if cfg.active_index(vb) != 0)
        for msg in (m.StreamRequest(vbucket=wrong, start_seqno=0, end_seqno=INF), m.GetFailoverLog(vbucket=wrong)):
            frames.append((False, m.encode(dataclasses.replace(msg, opaque=c.opaque + 1))))
            rsp = c.call(msg)
            assert rsp.status == Status.NOT_MY_VBUCKET
            frames.append((True, c.wire[id(rsp)]))
        c.close()
        port = srv.port
    pdus = tshark_frames(frames, port=port)
    assert len(pdus) == len(frames)
    problems = []
    for (_, raw), ts in zip(frames, pdus):
        row = m.to_row(m.decode_bytes(raw))
        problems += [f"{row['op']}: {d}" for d in compare(row, raw, ts)]
    assert problems == []
