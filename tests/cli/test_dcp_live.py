"""Integration over real loopback sockets: `dcptool stream` against the DCP producer
(in-process on its own loop, or `dcptool serve dcp` as a subprocess). Bounded in time;
every server is stopped by the test."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import signal
import socket
import subprocess
import time

import orjson
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.transport.dcp_client import Session
from tests.support.cli_util import self_signed_tls
from tests.support.paths import DCPTOOL
from tests.support.ports import refused_port
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration


def stream(server, *args, env=None, bucket="default"):
    url = f"couchbase://{server.host}:{server.port}/{bucket}"
    runner = CliRunner(mix_stderr=False) if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else CliRunner()
    res = runner.invoke(cli, ["stream", url, "--format", "jsonl", *args], env=env or {}, catch_exceptions=False)
    rows = [orjson.loads(line) for line in res.stdout.splitlines() if line.strip()]
    return res, rows


def items_by_vb(rows, applying_rollbacks=True):
    """{vb: [(seqno, key)]} of received items; a ROLLBACK answer truncates its vbucket."""
    out: dict[int, list] = {}
    for r in rows:
        if r["direction"] != "in":
            continue
        if r["op"] in ("mutation", "deletion", "expiration"):
            out.setdefault(r["vbucket"], []).append((r["by_seqno"], r["key"].encode()))
        elif applying_rollbacks and r["op"] == "stream_req" and r.get("status") == 0x23:
            vb, rb = r["vbucket"], r["rollback_seqno"]
            out[vb] = [x for x in out.get(vb, []) if x[0] <= rb]
    return out


def expected(model):
    return {vb.vbid: [(it.seqno, it.key) for it in vb.items()] for vb in model.buckets["default"].vbuckets
            if vb.high_seqno}


def test_64_vbuckets_exactly_once_in_order():
    model = P.server_from_options(vbuckets=64, items=6000, seed=11)
    with ThreadedServer(model) as srv:
        res, rows = stream(srv)
    assert res.exit_code == 0, res.stderr
    got = items_by_vb(rows)
    assert got == expected(model)
    assert sum(len(v) for v in got.values()) == 6000
    ends = [r for r in rows if r["op"] == "stream_end"]
    assert len(ends) == 64 and {r["stream_end_reason"] for r in ends} == {0}
    assert {r["direction"] for r in rows} == {"in", "out"} and all("ts" in r for r in rows)
    # responses carry the vbucket of their request
    rsps = [r for r in rows if r["op"] == "stream_req" and r["direction"] == "in"]
    assert sorted(r["vbucket"] for r in rsps) == list(range(64))
    assert all(r["failover_log"][0]["seqno"] == 0 for r in rsps)


def test_failover_forces_rollback_and_the_consumer_finishes():
    model = P.server_from_options(vbuckets=16, items=3000, seed=12,
                                  scenarios=P.Scenarios(failover_at=2500, failover_loss=10))
    with ThreadedServer(model) as srv:
        res, rows = stream(srv)
    assert res.exit_code == 0, res.stderr
    assert "ROLLBACK" in res.stderr
    assert {r["conn"] for r in rows} == {1, 2}
    rollbacks = [r for r in rows if r["op"] == "stream_req" and r.get("status") == 0x23]
    assert rollbacks
    reqs = [r for r in rows if r["op"] == "stream_req" and r["direction"] == "out" and r["conn"] == 2]
    for rb in rollbacks:
        after = [q for q in reqs if q["vbucket"] == rb["vbucket"] and q["opaque"] > rb["opaque"]]
        assert after[0]["req_start_seqno"] == rb["rollback_seqno"]
    assert items_by_vb(rows) == expected(model)   # no gap, no duplicate, the new branch


def test_every_stream_end_reason_decodes():
    model = P.server_from_options(vbuckets=9, items=2000, seed=13,
                                  scenarios=P.Scenarios(end_reasons=tuple(range(9))))
    with ThreadedServer(model) as srv:
        res, rows = stream(srv, "--collections")
    assert res.exit_code == 0, res.stderr
    first = {}
    for r in rows:
        if r["op"] == "stream_end":
            first.setdefault(r["vbucket"], r["stream_end_reason"])
    assert first == {vb: vb for vb in range(9)}
    for reason in dcp_consumer.DEFAULT_REOPEN:   # re-requested streams complete
        got = items_by_vb(rows)[reason]
        assert [s for s, _ in got] == list(range(1, model.buckets["default"].vbuckets[reason].high_seqno + 1))


def test_noops_answered_and_silent_consumer_dropped():
    model = P.server_from_options(vbuckets=2, items=10, seed=1)
    with ThreadedServer(model) as srv:
        cfg = dcp_consumer.ConsumerConfig(bucket="default", name="noop-test", to="forever", noop_interval=0.2)
        seen = {"noops": 0}
        session = None

        class Tap:
            def on_received(self, buf, offsets, lengths, ts, mono):
                for o in offsets.tolist():
                    if buf[o] == 0x80 and buf[o + 1] == 0x5C:
                        seen["noops"] += 1
                if seen["noops"] >= 3:
                    session.stop()

            def on_sent(self, frame, ts, mono):
                pass

        session = Session(cfg, srv.host, srv.port, tap=Tap())
        consumer = asyncio.run(asyncio.wait_for(session.run(), 20))
        assert seen["noops"] >= 3 and consumer.receiver.noops_answered >= 3
        st = model.stats[0]
        assert st["noops_answered"] >= 2 and st["closed"] != "noop not answered"

        # a client that never answers: dropped after one interval
        with socket.create_connection((srv.host, srv.port), timeout=10) as s:
            for msg in (m.SelectBucket(bucket=b"default"), m.DcpOpen(name=b"mute", flags=1),
                        m.Control(key=b"set_noop_interval", value=b"0.2"),
                        m.Control(key=b"enable_noop", value=b"true")):
                s.sendall(m.encode(msg))
            got = b""
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            else:
                pytest.fail("the producer did not drop a client that ignores noops")
        assert model.stats[-1]["closed"] == "noop not answered"
        assert model.stats[-1]["noops_sent"] == 1 and got.count(bytes([0x80, 0x5C])) == 1


def test_flow_control_with_a_slow_consumer():
    """A consumer whose queue is full on every other look: the producer blocks on the 64 KiB
    window (never more than one frame over it) and the acks free it until the last item.
    (An ack held back because the queue was full at the consumer's look goes out at the
    transport's look when that finds room: tests/protocol/dcp/test_transport_receive.py.)"""
    model = P.server_from_options(vbuckets=8, items=8000, seed=3)
    buffer = 64 * 1024
    with ThreadedServer(model) as srv:
        cfg = dcp_consumer.ConsumerConfig(bucket="default", name="slow", buffer_size=buffer, noop_interval=0.5)
        calls = {"n": 0}

        def should_pause():   # the capture's queue is "full" on every other look
            calls["n"] += 1
            return calls["n"] % 2 == 0

        session = Session(cfg, srv.host, srv.port, should_pause=should_pause)
        consumer = asyncio.run(asyncio.wait_for(session.run(), 60))
    assert consumer.finished and consumer.receiver.data_frames == 8000
    st = model.stats[0]
    assert st["flow_blocked"] > 0
    assert buffer <= st["max_outstanding"] < buffer + 128   # never more than one frame over
    assert st["acked"] >= 8000 * 128 - buffer


def test_scram_wrong_password_exits_4_and_right_one_works():
    model = P.server_from_options(vbuckets=4, items=100, users={"admin": "s3cret"})
    with ThreadedServer(model) as srv:
        res, rows = stream(srv, "--user", "admin", env={"DCPTOOL_PASSWORD": "wrong"})
        assert res.exit_code == 4
        assert "refused" in res.stderr and "wrong" not in res.stderr and "s3cret" not in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
        res, rows = stream(srv, "--user", "admin", env={"DCPTOOL_PASSWORD": "s3cret"})
        assert res.exit_code == 0, res.stderr
        assert sum(len(v) for v in items_by_vb(rows).values()) == 100
        mechs = [r["key"].encode() for r in rows if r["op"] == "sasl_auth" and r["direction"] == "out"]
        assert mechs == [b"SCRAM-SHA512"]


def test_unknown_bucket_exits_with_the_server_status():
    model = P.server_from_options(vbuckets=1, items=1)
    with ThreadedServer(model) as srv:
        res, _ = stream(srv, bucket="nope")
    assert res.exit_code in (4, 5)
    assert "nope" in res.stderr and "0x01" in res.stderr


def test_refused_port_exits_3():
    with refused_port() as port:
        res = CliRunner().invoke(cli, ["stream", f"couchbase://127.0.0.1:{port}/default"])
    assert res.exit_code == 3
    assert "refused" in res.output


def test_tls_to_a_plain_port_says_what_answered():
    # what answered and what to do, exit 5 as every wrong server (CLI.md; test_wrong_server.py)
    model = P.server_from_options(vbuckets=1, items=1)
    with ThreadedServer(model) as srv:
        res = CliRunner().invoke(cli, ["stream", f"couchbases://{srv.host}:{srv.port}/default", "--insecure"])
    assert res.exit_code == 5
    assert "without TLS" in res.output and "use couchbase://" in res.output


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")
def test_tls_session(tmp_path):
    ctx, cert = self_signed_tls(tmp_path)
    model = P.server_from_options(vbuckets=4, items=200, users={"u": "pw"})
    with ThreadedServer(model, tls=ctx) as srv:
        url = f"couchbases://{srv.host}:{srv.port}/default"
        res = CliRunner().invoke(cli, ["stream", url, "--user", "u", "--ca-cert", str(cert), "--format", "jsonl"],
                                 env={"DCPTOOL_PASSWORD": "pw"})
        assert res.exit_code == 0, res.output
        rows = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
        assert sum(1 for r in rows if r["op"] == "mutation") == 200
        # over TLS PLAIN is allowed, SCRAM is still preferred
        assert [r["key"].encode() for r in rows if r["op"] == "sasl_auth" and r["direction"] == "out"] == [b"SCRAM-SHA512"]
        res = CliRunner().invoke(cli, ["stream", url, "--user", "u"], env={"DCPTOOL_PASSWORD": "pw"})
        assert res.exit_code == 3 and "certificate" in res.output


def test_silent_producer_is_a_dead_connection(monkeypatch):
    from dcptool.capture import dcp_session
    monkeypatch.setitem(dcp_session.DEFAULTS, "reconnects", 1)
    model = P.server_from_options(vbuckets=2, items=100, scenarios=P.Scenarios(silent=True))
    with ThreadedServer(model) as srv:
        res, rows = stream(srv, "--noop-interval", "0.2")
    assert res.exit_code == 1
    assert "no frame from the producer" in res.stderr
    assert {r["conn"] for r in rows} == {1, 2}


def test_fast_mutation_rows_equal_the_codec():
    from dcptool.live.dcp_rows import RowTap
    from dcptool.replay.display import dcp_display
    from dcptool.replay.rows import row_columns
    frame = m.encode(m.Mutation(vbucket=7, opaque=9, cas=123, datatype=1, key=b"k1", value=b'{"a":1}',
                                by_seqno=5, rev_seqno=2, item_flags=3, expiration=4, lock_time=6))
    import numpy as np
    tap = RowTap(None, values=True, raw=True, max_messages=None)
    fast, = tap.rows(frame, np.zeros(1, np.int64), np.array([len(frame)]), "T", "in")
    want = dict.fromkeys(row_columns(values=True, raw=True))
    want.update({"frame_no": 0, "ts": "T", "conn": 0, "direction": "in",
                 **m.to_row(m.decode_bytes(frame), raw=frame, value=True)})
    dcp_display(want)
    assert fast == want and list(fast) == list(want)
    assert fast["key"] == "k1" and fast["value"] == {"a": 1} and fast["value_base64"] is None


def _serve_subprocess(*args):
    proc = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    addr = json.loads(line)["listening"]
    return proc, addr


def test_serve_subprocess_and_ctrl_c_exits_130():
    proc, addr = _serve_subprocess("--items", "2000", "--vbuckets", "8", "--rate", "200")
    try:
        host, port = addr.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        out = subprocess.run([DCPTOOL, "stream", f"couchbase://{addr}/default", "--max-messages", "50"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rows = [json.loads(x) for x in out.stdout.splitlines()]
        assert sum(1 for r in rows if r["direction"] == "in") == 50
        s = subprocess.Popen([DCPTOOL, "stream", f"couchbase://{addr}/default", "--to", "forever"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(5000):   # wait for live data, then Ctrl-C
                line = s.stdout.readline()
                if '"mutation"' in line and '"by_seqno"' in line:
                    break
            s.send_signal(signal.SIGINT)
            rest, err = s.communicate(timeout=30)
        finally:
            if s.poll() is None:
                s.kill()
        assert s.returncode == 130, err
        assert "interrupted" in err
        assert '"close_stream"' in rest   # the streams were closed before exiting
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_batch_rows_equal_the_codec_in_jsonl():
    import numpy as np

    from dcptool.live.dcp_rows import RowTap
    from dcptool.replay.display import dcp_display
    from dcptool.replay.rows import row_columns
    frames = [m.encode(m.Mutation(vbucket=3, opaque=4, cas=5 + i, datatype=1, key=b"key-%d" % i, value=b"{}",
                                  by_seqno=10 + i, rev_seqno=1)) for i in range(3)]
    frames.insert(1, m.encode(m.SnapshotMarker(vbucket=3, opaque=4, snap_start=1, snap_end=20, snap_flags=2)))
    buf = b"".join(frames)
    offs = np.cumsum([0] + [len(f) for f in frames[:-1]])
    lens = np.array([len(f) for f in frames])

    class Sink:
        rows = []

        def write_many(self, rows):
            self.rows.extend(rows)

    tap = RowTap(Sink(), values=False, raw=False, max_messages=None)
    tap.on_received(buf, offs, lens, 1_700_000_000_123_456_789, 0)
    want = []
    for i, f in enumerate(frames):
        row = dict.fromkeys(row_columns())
        row.update({"frame_no": i, "ts": "2023-11-14T22:13:20.123456789Z", "conn": 0, "mono_ns": 0,
                    "direction": "in", **m.to_row(m.decode_bytes(f))})
        want.append(dcp_display(row))
    assert Sink.rows == want and [list(r) for r in Sink.rows] == [list(r) for r in want]


def test_unknown_host_exits_3():
    res = CliRunner().invoke(cli, ["stream", "couchbase://no-such-host.invalid:11210/default", "--timeout", "5s"])
    assert res.exit_code == 3
    assert "no-such-host.invalid" in res.output


def test_raw_sasl_frames_are_masked():
    model = P.server_from_options(vbuckets=1, items=2, users={"admin": "s3cret"})
    with ThreadedServer(model) as srv:
        res, rows = stream(srv, "--user", "admin", "--raw", "--values", env={"DCPTOOL_PASSWORD": "s3cret"})
    assert res.exit_code == 0, res.stderr
    sasl_out = [r for r in rows if r["op"] in ("sasl_auth", "sasl_step") and r["direction"] == "out"]
    assert len(sasl_out) == 2
    for r in sasl_out:
        raw = base64.b64decode(r["raw"])
        assert raw.endswith(b"*" * r["value_len"]) and set(base64.b64decode(r["value_base64"])) == {ord("*")}
    assert b"s3cret" not in res.stdout.encode()
