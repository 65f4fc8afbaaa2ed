"""Issue 25, first part: route by the newest map (a vbucket that moves away and back is
served again, on the node it left), and DCP names per node and bucket, as Couchbase keeps
them (the same name on every node of `serve dcp --nodes 3` is fine; twice on one node the
second replaces the first)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from dcptool.protocol.dcp.client import routing
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig, Node
from dcptool.protocol.dcp.wire.frames import FrameParser
from tests.support.threaded_server import ThreadedServer

DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
A, B = "127.0.0.1:1", "127.0.0.1:2"


def _config(vbmap, rev):
    return ClusterConfig(rev=rev, rev_epoch=1, name="default", uuid="u",
                         nodes=(Node("127.0.0.1", 1), Node("127.0.0.1", 2)),
                         vbucket_map=tuple(map(tuple, vbmap))).render()


# --------------------------------------------------------------------------- the router, sans-IO

def test_a_vbucket_goes_back_to_the_node_it_left_by_the_newest_map_with_backoff():
    r = routing.Router(None)
    assert r.apply(_config([[0], [1]], rev=1), "127.0.0.1")      # vb 0 on A, vb 1 on B
    assert r.apply(_config([[1], [1]], rev=2), "127.0.0.1")      # moved to B ...
    assert r.apply(_config([[0], [1]], rev=3), "127.0.0.1")      # ... and back to A (a failover of B)
    # its stream on A was refused, and the newest map held names A: not never, but after a backoff
    r.wait(0, A, now=10.0, timeout=30.0, why=routing.REFUSED)
    assert r.ready(now=10.0) == {}
    assert r.next_retry() == pytest.approx(10.0 + routing.RETRY_FIRST)
    assert r.next_retry({A}) is None            # a node known down has its own backoff
    assert r.ready(now=10.0 + routing.RETRY_FIRST) == {A: [0]}
    # refused again: the backoff doubles; served resets it
    r.wait(0, A, now=11.0, timeout=30.0, why=routing.REFUSED)
    assert r.ready(now=11.0 + routing.RETRY_FIRST) == {}
    assert r.ready(now=11.0 + 2 * routing.RETRY_FIRST) == {A: [0]}
    for k in range(10):
        r.wait(0, A, now=12.0, timeout=30.0, why=routing.REFUSED)
        assert r.waiting[0].retry_at - 12.0 <= routing.RETRY_MAX
        r.ready(now=100.0)
    r.served(0)
    r.wait(0, A, now=20.0, timeout=30.0, why=routing.REFUSED)
    assert r.waiting[0].retry_at == pytest.approx(20.0 + routing.RETRY_FIRST)
    # a newer map, or another owner, goes at once
    assert r.apply(_config([[0], [1]], rev=4), "127.0.0.1")
    assert r.ready(now=20.0) == {A: [0]}
    r.wait(1, A, now=21.0, timeout=30.0, why=routing.REFUSED)
    assert r.ready(now=21.0) == {B: [1]}


def test_a_stream_that_ended_goes_to_the_newest_owner_at_once_even_the_node_it_left():
    r = routing.Router(None)
    assert r.apply(_config([[0], [1]], rev=5), "127.0.0.1")
    r.wait(0, A, now=1.0, timeout=30.0, why=routing.REFUSED, backoff=False)   # a handoff on A
    assert r.ready(now=1.0) == {A: [0]}
    # without a time (the old call) only another owner or a newer map moves it
    r.wait(0, A, now=2.0, timeout=30.0, why=routing.REFUSED)
    assert r.ready() == {}


def test_the_timeout_still_bounds_a_vbucket_that_is_never_served():
    r = routing.Router(None)
    assert r.apply(_config([[0], [-1]], rev=1), "127.0.0.1")
    r.wait(0, A, now=0.0, timeout=5.0, why=routing.REFUSED)
    r.wait(1, None, now=0.0, timeout=5.0, why=routing.NO_ACTIVE)
    assert r.ready(now=1.0) == {A: [0]}
    r.wait(0, A, now=1.0, timeout=5.0, why=routing.REFUSED)   # refused again: the deadline stays at 5
    assert r.expire(4.9) == {}
    assert r.expire(5.0) == {0: routing.REFUSED, 1: routing.NO_ACTIVE}
    assert not r.waiting and r.unserved == {0: routing.REFUSED, 1: routing.NO_ACTIVE}


# --------------------------------------------------------------------------- move away and back

@pytest.mark.integration
def test_vbuckets_moved_away_and_back_are_served_again(tmp_path):
    """Issue 25's scenario as reported: a rebalance moves vbuckets to node 2, the failover
    of node 2 promotes them back on the node their streams had left."""
    serve = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", "--nodes", "3", "--replicas", "1",
                              "--vbuckets", "64", "--items", "60000", "--seed", "31", "--slow", "10ms",
                              "--slow-frames", "200", "--rebalance-at", "2", "--failover-at", "4:2"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = serve.stdout.readline()
        assert line, serve.stderr.read()
        node0 = json.loads(line)["listening"]
        res = subprocess.run([DCPTOOL, "capture", f"couchbase://{node0}/default", "--to", "now", "-o",
                              str(tmp_path / "c"), "--quiet", "--timeout", "20s"],
                             capture_output=True, text=True, timeout=120)
    finally:
        serve.terminate()
        serve.wait(20)
    assert res.returncode == 0, res.stderr
    assert "could not be served" not in res.stderr
    docs = subprocess.run([DCPTOOL, "replay", str(tmp_path / "c"), "--table", "documents", "--format", "jsonl"],
                          capture_output=True, text=True, timeout=120)
    assert docs.returncode == 0, docs.stderr
    keys = {json.loads(ln)["key"] for ln in docs.stdout.splitlines()}
    assert len(keys) == 60000          # a failover rewrites the lost tail: every key survives


# --------------------------------------------------------------------------- DCP names per node

class Raw:
    """A blocking raw-frame DCP client (127.0.0.1, bounded waits)."""

    def __init__(self, port: int):
        self.s = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.parser = FrameParser()
        self.frames: list = []
        self.closed = False

    def send(self, *msgs) -> None:
        self.s.sendall(b"".join(m.encode(x) for x in msgs))

    def until(self, pred, bound: float = 20.0) -> bool:
        """Read until pred(frames) holds (True) or the server closes (False)."""
        end = time.monotonic() + bound
        while not pred(self.frames):
            if time.monotonic() > end:
                raise AssertionError("no answer in time")
            data = self.s.recv(65536)
            if not data:
                self.closed = True
                return False
            self.frames += [m.decode(f) for f in self.parser.feed(data)]
        return True

    def open(self, name: bytes) -> None:
        self.send(m.SelectBucket(bucket=b"default", opaque=1), m.DcpOpen(name=name, flags=1, opaque=2))
        assert self.until(lambda fs: any(f.IS_RESPONSE and f.opaque == 2 for f in fs))
        assert [f.status for f in self.frames if f.IS_RESPONSE] == [0, 0]

    def stream(self, vb: int) -> None:
        self.send(m.StreamRequest(vbucket=vb, opaque=100 + vb, start_seqno=0, end_seqno=(1 << 64) - 1,
                                  vbucket_uuid=0, snap_start=0, snap_end=0, flags=0))

    def close(self) -> None:
        self.s.close()


def _items(frames, vb):
    return [f for f in frames if isinstance(f, m.Mutation) and f.vbucket == vb]


def test_the_same_dcp_name_on_every_node_streams_from_each():
    model = P.server_from_options(vbuckets=8, items=400, seed=25, nodes=3, replicas=1)
    with ThreadedServer(model) as srv:
        clients = [Raw(port) for _, port in srv.addresses]
        try:
            for c in clients:
                c.open(b"one-name-everywhere")
            for node, c in enumerate(clients):
                vb = model.cluster.active_vbuckets(node)[0]
                want = model.buckets["default"].vbuckets[vb].high_seqno
                c.stream(vb)
                assert c.until(lambda fs, vb=vb, want=want: len(_items(fs, vb)) == want), f"node {node} closed"
                assert [f.by_seqno for f in _items(c.frames, vb)] == list(range(1, want + 1))
            assert not any(c.closed for c in clients)
            assert [st["closed"] for st in model.stats] == [None, None, None]
        finally:
            for c in clients:
                c.close()


def test_the_same_dcp_name_twice_on_one_node_replaces_the_first():
    model = P.server_from_options(vbuckets=8, items=400, seed=25, nodes=3, replicas=1)
    with ThreadedServer(model) as srv:
        port = srv.addresses[1][1]
        first, second = Raw(port), Raw(port)
        try:
            first.open(b"twice")
            second.open(b"twice")
            assert not first.until(lambda fs: False)          # the server closed the first
            assert first.closed and not second.closed
            vb = model.cluster.active_vbuckets(1)[0]
            second.stream(vb)
            assert second.until(lambda fs: len(_items(fs, vb)) > 0)
            assert model.stats[0]["closed"] == "replaced by a connection with the same name"
            assert model.stats[1]["closed"] is None
        finally:
            first.close()
            second.close()
