"""The consumer side of a cluster (docs/CLUSTER.md): seed lists, routing by the map, and
`stream` against `serve dcp --nodes 3 --replicas 1` with a rebalance and a failover, checked
against the producer's own final bucket contents. Fake servers for a malformed config and a
map that leaves a vbucket without a node. Everything on 127.0.0.1, bounded in time."""

from __future__ import annotations

import os
import shutil
import subprocess

import click
import orjson
import pytest

from dcptool.cli.sources import parse_source
from dcptool.protocol.dcp.client import routing
from dcptool.protocol.dcp.client.consumer import (
    ConfigReceived,
    ConnPhase,
    Consumer,
    ConsumerConfig,
    Handoff,
    NotMyVbucket,
    VbState,
)
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.cluster import Event
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.cluster_config import ClusterConfig, Node
from tests.support.cli_util import error_line, self_signed_tls
from tests.support.cluster_state import ROLLBACK, final_state, survivors
from tests.support.hostile_dcp import HostileDcp
from tests.support.paths import DCPTOOL
from tests.support.ports import refused_port
from tests.support.threaded_server import ThreadedServer

BOUND = 120


def run(url, *args, cmd="stream"):
    full = [DCPTOOL, cmd, url, "--timeout", "5s", *args]
    if cmd == "stream":
        full += ["--format", "jsonl"]
    res = subprocess.run(full, capture_output=True, text=True, timeout=BOUND)
    rows = [orjson.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")] if cmd == "stream" else []
    return res, rows


def cluster_model(seed=5, items=6000, events=None):
    events = events if events is not None else (Event(1500, "rebalance"), Event(3500, "failover", 1))
    # with topology events, paced (16 frames per connection every 10 ms): every node is still
    # streaming when a node fails, whatever the load (an unpaced node could finish first and
    # leave nothing to roll back)
    pace = {"slow": 0.01, "slow_frames": 16} if events else {}
    return P.server_from_options(vbuckets=16, items=items, seed=seed, nodes=3, replicas=1, events=tuple(events),
                                 scenarios=P.Scenarios(failover_loss=12, **pace))


# --------------------------------------------------------------------------- seed lists

def test_seed_list_parses_every_seed_with_default_ports():
    s = parse_source("couchbase://h1,h2:11999,[::1]/bucket")
    assert s.seeds == (("h1", 11210), ("h2", 11999), ("::1", 11210))
    assert (s.host, s.port, s.bucket) == ("h1", 11210, "bucket")
    assert s.url == "couchbase://h1:11210,h2:11999,[::1]:11210/bucket"
    t = parse_source("couchbases://a,b/x")
    assert t.seeds == (("a", 11207), ("b", 11207)) and t.tls
    assert parse_source("couchbase://one:1234/b").seeds == (("one", 1234),)


@pytest.mark.parametrize("url", ["couchbase://h1,,h2/b", "couchbase://h1,h2:x/b", "couchbase://h1,[::1/b",
                                 "couchbase://h1,h2:70000/b", "couchbase://h1,::1/b"])
def test_bad_seeds_are_one_line_usage_errors(url):
    with pytest.raises(click.BadParameter):
        parse_source(url)
    res = subprocess.run([DCPTOOL, "stream", url], capture_output=True, text=True, timeout=BOUND)
    assert res.returncode == 2 and "Traceback" not in res.stderr


# --------------------------------------------------------------------------- sans-IO pieces

def _config(nodes, vbmap, rev=1):
    return ClusterConfig(rev=rev, rev_epoch=1, name="default", uuid="u",
                         nodes=tuple(Node("127.0.0.1", p) for p in nodes), vbucket_map=tuple(map(tuple, vbmap)))


def test_router_waits_for_a_newer_map_or_another_owner():
    r = routing.Router(None)
    assert r.apply(_config([1, 2], [[0], [1], [-1]]).render(), "127.0.0.1")
    assert not r.apply(_config([1, 2], [[1], [1], [1]]).render(), "127.0.0.1")   # same rev: ignored
    assert r.plan(r.wanted()) == {"127.0.0.1:1": [0], "127.0.0.1:2": [1]}
    r.wait(0, "127.0.0.1:1", now=0.0, timeout=5.0, why=routing.REFUSED)     # refused by its owner
    r.wait(2, None, now=0.0, timeout=5.0, why=routing.NO_ACTIVE)
    assert r.ready() == {}                      # same map, same owner; vb 2 has none
    assert r.apply(_config([1, 2], [[1], [1], [-1]], rev=2).render(), "127.0.0.1")
    assert r.ready() == {"127.0.0.1:2": [0]}
    assert r.expire(4.9) == {} and r.expire(5.0) == {2: routing.NO_ACTIVE}
    assert r.unserved == {2: routing.NO_ACTIVE} and not r.waiting
    assert routing.split([1, 2, 3, 4, 5], 2) == [[1, 3, 5], [2, 4]]


def _handshake(c: Consumer, config_body: bytes | None) -> list:
    """Answer every request the consumer sent until it streams; returns the events."""
    events = []
    for _ in range(20):
        out = c.outgoing()
        if not out:
            break
        for raw in out:
            req = m.decode_bytes(raw)
            op = req.op_code
            if op == 0xB5:
                rsp = m.Response(opcode=0xB5, opaque=req.opaque, status=0 if config_body else 0x81,
                                 value=config_body or b"")
            elif op == 0x1F:
                rsp = m.HelloResponse(opaque=req.opaque, features=())
            elif op == 0x53:
                rsp = m.StreamRequestResponse(opaque=req.opaque, failover_log=((7, 0),))
            else:
                rsp = m.Response(opcode=op, opaque=req.opaque)
            events += c.feed(m.encode(rsp), 1.0)
            for e in events:
                if type(e) is ConfigReceived and e.bootstrap and c.handshake.phase is ConnPhase.ROUTING:
                    c.route([3, 4], states={3: VbState(last_seqno=5, failover_log=[(7, 0)])}, handoff=True)
    return events


def test_consumer_asks_the_map_waits_for_route_then_hands_vbuckets_back():
    c = Consumer(ConsumerConfig(bucket="default", name="t", fetch_config=True))
    c.start(0.0)
    body = _config([1], [[0]] * 8).render()
    ev = _handshake(c, body)
    assert [e for e in ev if type(e) is ConfigReceived] == [ConfigReceived(body, 0, True)]
    assert c.handshake.streaming and sorted(c.unfinished()) == [3, 4]
    assert c.streams.states[3].last_seqno == 5                   # adopted state: resumes from it
    ev = c.feed(m.encode(m.StreamEnd(vbucket=3, reason=2, opaque=c.streams.opaque_of(3))), 2.0)
    assert Handoff(3, 2) in ev                           # "state changed": back to the session
    st = c.take_states([3])
    assert st[3].last_seqno == 5 and c.unfinished() == [4]
    # a refused stream request hands the vbucket back with the config in the body
    c.add_vbuckets({5: VbState()})
    (req,) = [m.decode_bytes(f) for f in c.outgoing()]
    ev = c.feed(m.encode(m.StreamRequestResponse(opaque=req.opaque, status=0x07, value=b"{cfg}")), 3.0)
    assert NotMyVbucket(5, b"{cfg}") in ev
    assert set(c.take_states([5])) == {5}


def test_a_vbucket_handed_back_to_a_connection_whose_last_stream_just_ended_keeps_it_open():
    """The last open stream of a connection ends "state changed" and the map hands it straight
    back to the same connection (in the same receive): the connection is not finished until
    that stream ends too (before, it stayed finished, the session ended it, and the vbucket
    was never streamed again: seen under load as a flaky cluster test)."""
    c = Consumer(ConsumerConfig(bucket="default", name="t", fetch_config=True))
    c.start(0.0)
    _handshake(c, _config([1], [[0]] * 8).render())
    for vb in (3, 4):
        c.feed(m.encode(m.StreamEnd(vbucket=vb, reason=2, opaque=c.streams.opaque_of(vb))), 2.0)
    states = c.take_states([3, 4])        # the session takes what was handed off
    assert c.finished and c.unfinished() == []
    c.add_vbuckets({4: states[4]})        # ... and the map gives 4 straight back
    assert not c.finished and c.unfinished() == [4]
    (req,) = [m.decode_bytes(f) for f in c.outgoing()]
    assert type(req) is m.StreamRequest and req.vbucket == 4


# --------------------------------------------------------------------------- against serve dcp

def test_stream_follows_rebalance_and_failover_every_survivor_once():
    model = cluster_model()
    with ThreadedServer(model) as srv:
        res, rows = run(f"couchbase://{srv.host}:{srv.port}/default")
        nodes = [f"{h}:{p}" for h, p in srv.addresses]
    assert res.returncode == 0, res.stderr
    assert model.cluster.changes and {c.kind for c in model.cluster.changes} == {"rebalance", "failover"}
    assert {r["node"] for r in rows} <= set(nodes) and len({r["node"] for r in rows}) == 3
    assert len({r["conn"] for r in rows}) >= 3
    got = survivors(rows)
    assert got == final_state(model)
    summary = res.stderr.strip().splitlines()[-1]
    assert "unserved" not in summary and "rollbacks=" in summary
    # the stream ends, reroutes and rollbacks are all there as rows
    assert any(r["op"] == "stream_end" and r["stream_end_reason"] == 2 for r in rows)
    assert any(r["op"] == "stream_req" and r["status"] == ROLLBACK for r in rows)
    assert any(r["op"] == "get_cluster_config" and r["direction"] == "in" for r in rows)


def test_dead_first_seed_is_skipped():
    model = cluster_model(events=())
    with refused_port() as dead, ThreadedServer(model) as srv:
        res, rows = run(f"couchbase://127.0.0.1:{dead},{srv.host}:{srv.port}/default")
    assert res.returncode == 0, res.stderr
    assert survivors(rows) == final_state(model)


def test_all_seeds_dead_is_exit_3_with_one_line():
    with refused_port() as a, refused_port() as b:
        res, _ = run(f"couchbase://127.0.0.1:{a},127.0.0.1:{b}/default")
    assert res.returncode == 3
    line = error_line(res)
    assert "seeds" in line and str(a) in line and str(b) in line


class MapDcp(HostileDcp):
    """The hostile server, answering GET_CLUSTER_CONFIG with `config`."""

    def __init__(self, config: bytes = b"", **kw):
        super().__init__(**kw)
        self.config = config

    def _answer(self, f):
        if f.opcode == 0xB5:
            return self._rsp(f, value=self.config)
        return super()._answer(f)


def test_malformed_config_is_exit_5_and_capture_keeps_what_it_has(tmp_path):
    with MapDcp(b'{"rev": "seven", "name": "default"}') as srv:
        res, _ = run(srv.url)
        assert res.returncode == 5
        assert "malformed cluster config" in error_line(res)
        res, _ = run(srv.url, "-o", str(tmp_path), "--quiet", cmd="capture")
    assert res.returncode == 5
    from dcptool.replay.store.reader import find_captures, read_capture_table
    t = read_capture_table(find_captures([str(tmp_path)]), ["op", "direction"]).to_pylist()
    assert {"op": "get_cluster_config", "direction": "in"} in t


def test_vbucket_without_a_node_is_named_in_the_summary_and_exit_code():
    with MapDcp(vbuckets=4, items=3) as a, MapDcp(vbuckets=4, items=3) as b:
        cfg = _config([a.port, b.port], [[0], [1], [0], [-1]])
        a.config = cfg.render(0)
        b.config = cfg.render(1)
        res, rows = run(a.url, "--timeout", "1s")
        assert res.returncode == 1
        assert "1 vbucket(s) could not be served: 3: no active node" in error_line(res)
        assert "unserved_vbuckets=1" in res.stderr
        served = {r["vbucket"] for r in rows if r["op"] == "mutation"}
        assert served == {0, 1, 2}
        assert {r["node"] for r in rows} == {f"127.0.0.1:{a.port}", f"127.0.0.1:{b.port}"}
        # a vbucket beyond the map is a usage error, as on one node
        res, _ = run(a.url, "--vbuckets", "0,9")
        assert res.returncode == 2 and "out of range" in error_line(res)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_tls_and_scram_per_node(tmp_path):
    ctx, cert = self_signed_tls(tmp_path)
    model = P.server_from_options(vbuckets=8, items=400, seed=3, nodes=3, users={"u": "pw"})
    with ThreadedServer(model, tls=ctx) as srv:
        res = subprocess.run([DCPTOOL, "stream", f"couchbases://{srv.host}:{srv.port}/default", "--user", "u",
                              "--ca-cert", str(cert), "--format", "jsonl", "--conn-per-node", "2"],
                             capture_output=True, text=True, timeout=BOUND, env=dict(os.environ, DCPTOOL_PASSWORD="pw"))
    assert res.returncode == 0, res.stderr
    rows = [orjson.loads(ln) for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert survivors(rows) == final_state(model)
    auth = [r for r in rows if r["op"] == "sasl_auth" and r["direction"] == "out"]
    conns = {r["conn"] for r in rows}
    assert {r["conn"] for r in auth} == conns and {r["key"] for r in auth} == {"SCRAM-SHA512"}
    assert len(conns) >= 4 and len({r["node"] for r in rows}) == 3     # 2 per node (+ the bootstrap)


def test_node_down_without_a_replica_is_unserved_after_the_timeout():
    model = P.server_from_options(vbuckets=16, items=6000, seed=4, nodes=3, replicas=0,
                                  events=(Event(2000, "failover", 1),),
                                  scenarios=P.Scenarios(slow=0.01, slow_frames=16))   # node 1 still streaming then
    with ThreadedServer(model) as srv:
        res, rows = run(f"couchbase://{srv.host}:{srv.port}/default", "--timeout", "1s")
    (change,) = model.cluster.changes
    lost = sorted(mv.vb for mv in change.moves)
    assert lost and all(mv.new == -1 for mv in change.moves)
    assert res.returncode == 1
    line = error_line(res)
    assert f"{len(lost)} vbucket(s) could not be served" in line and "stopped answering" in line
    assert f"unserved_vbuckets={len(lost)}" in res.stderr
    got, want = survivors(rows), final_state(model)
    assert {vb: got.get(vb, {}) for vb in want if vb not in lost} == {vb: d for vb, d in want.items()
                                                                      if vb not in lost}
