"""`serve dcp|synapse --from CAPTURE`: a capture played back and captured again agrees with
the original (DCP per vbucket: items, markers, failover logs, rollbacks; Synapse: the
POSITION and RDATA lines); --pace original keeps the recorded gaps (fake clock); each
fault is seen by the consumer (a disconnect it resumes from, a stall, a damaged frame);
an unreadable capture is one error line before listening."""

from __future__ import annotations

import contextlib
import json
import subprocess

import numpy as np
import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.recorded_producer import (
    DcpRecording,
    Faults,
    PlaybackModel,
    RecordedStream,
)
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.synapse.recorded_server import (
    LineFaults,
    PlaybackFeed,
    PlaybackSession,
)
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration
ITEM_OPS = ("mutation", "deletion", "expiration", "system_event", "seqno_advanced")


# --------------------------------------------------------------------------- helpers

def run(*args, timeout=120, **kw):
    return subprocess.run([DCPTOOL, *args], capture_output=True, text=True, timeout=timeout, **kw)


@contextlib.contextmanager
def serving(*args):
    """`dcptool serve ...` in the background; yields its port; stopped with SIGTERM."""
    proc = subprocess.Popen([DCPTOOL, "serve", *args, "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        yield int(json.loads(line)["listening"].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        proc.wait(20)


def capture(url, outdir, *args):
    res = run("capture", url, "-o", str(outdir), "--quiet", "--json", *args)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def table(outdir):
    return read_capture_table(find_captures([str(outdir)]))


def dcp_view(outdir) -> dict:
    """Per vbucket, the `in` frames that do not depend on time: items (op, key, seqnos, cas,
    flags, the whole frame but its opaque), markers, stream ends, stream-request answers."""
    out: dict[int, list] = {}
    cols = ["direction", "op", "vbucket", "key", "by_seqno", "rev_seqno", "cas", "item_flags", "snap_start",
            "snap_end", "snap_flags", "status", "rollback_seqno", "failover_log", "stream_end_reason", "raw"]
    for r in table(outdir).select(cols).to_pylist():
        if r["direction"] != "in" or r["vbucket"] is None:
            continue
        op = r["op"]
        if op in ITEM_OPS:
            row = (op, r["key"], r["by_seqno"], r["rev_seqno"], r["cas"], r["item_flags"],
                   r["raw"][:12] + r["raw"][16:])
        elif op == "snapshot_marker":
            row = (op, r["snap_start"], r["snap_end"], r["snap_flags"])
        elif op == "stream_end":
            row = (op, r["stream_end_reason"])
        elif op == "stream_req":
            row = (op, r["status"], r["rollback_seqno"], json.dumps(r["failover_log"]))
        else:
            continue
        out.setdefault(r["vbucket"], []).append(row)
    return out


def items_by_vb(view: dict) -> dict:
    return {vb: sorted({(r[2], r[1]) for r in rows if r[0] in ITEM_OPS}) for vb, rows in view.items()}


@pytest.fixture(scope="module")
def dcp_original(tmp_path_factory):
    d = tmp_path_factory.mktemp("orig") / "c"
    model = P.server_from_options(vbuckets=8, items=2000, seed=7, checkpoint_items=50)
    with ThreadedServer(model) as srv:
        capture(f"couchbase://127.0.0.1:{srv.port}/default", d)
    return d


# --------------------------------------------------------------------------- round trips

def test_dcp_round_trip_equal(dcp_original, tmp_path):
    with serving("dcp", "--from", str(dcp_original)) as port:
        summary = capture(f"couchbase://127.0.0.1:{port}/default", tmp_path / "again")
    assert summary["stopped"] == "to"
    a, b = dcp_view(dcp_original), dcp_view(tmp_path / "again")
    assert len(a) == 8 and sum(len(v) for v in a.values()) > 2000
    assert a == b


def test_dcp_round_trip_with_failover_and_rollback(tmp_path):
    model = P.server_from_options(vbuckets=4, items=800, seed=11)
    model.scenarios.failover_at = 300
    with ThreadedServer(model) as srv:
        first = capture(f"couchbase://127.0.0.1:{srv.port}/default", tmp_path / "a")
    assert first["connections"] == 2 and first["rollbacks"] > 0
    with serving("dcp", "--from", str(tmp_path / "a")) as port:
        again = capture(f"couchbase://127.0.0.1:{port}/default", tmp_path / "b")
    assert again["connections"] == 2 and again["rollbacks"] == first["rollbacks"]
    assert dcp_view(tmp_path / "a") == dcp_view(tmp_path / "b")


def synapse_view(outdir) -> list:
    return [(r["command"], r["raw"]) for r in table(outdir).select(["direction", "command", "raw"]).to_pylist()
            if r["direction"] == "in" and r["command"] in ("RDATA", "POSITION")]


@pytest.fixture(scope="module")
def synapse_original(tmp_path_factory):
    d = tmp_path_factory.mktemp("sorig") / "c"
    with serving("synapse", "--items", "400", "--seed", "5") as port:
        capture(f"synapse://127.0.0.1:{port}", d, "--max-messages", "380")
    return d


def test_synapse_round_trip_equal(synapse_original, tmp_path):
    a = synapse_view(synapse_original)
    assert len(a) > 300 and {c for c, _ in a} == {"RDATA", "POSITION"}
    # everything the original received (SERVER, PING and the replication lines) comes back
    n_in = sum(1 for d in table(synapse_original).column("direction").to_pylist() if d == "in")
    with serving("synapse", "--from", str(synapse_original)) as port:
        capture(f"synapse://127.0.0.1:{port}", tmp_path / "b", "--max-messages", str(n_in))
    assert synapse_view(tmp_path / "b") == a


# --------------------------------------------------------------------------- faults

def test_dcp_disconnect_is_resumed_without_loss(dcp_original, tmp_path):
    with serving("dcp", "--from", str(dcp_original), "--disconnect-at", "700") as port:
        summary = capture(f"couchbase://127.0.0.1:{port}/default", tmp_path / "b")
    assert summary["connections"] == 2 and summary["stopped"] == "to"
    assert items_by_vb(dcp_view(tmp_path / "b")) == items_by_vb(dcp_view(dcp_original))


def test_dcp_stall_then_everything(dcp_original, tmp_path):
    with serving("dcp", "--from", str(dcp_original), "--stall-at", "500:300ms") as port:
        summary = capture(f"couchbase://127.0.0.1:{port}/default", tmp_path / "b")
    assert summary["connections"] == 1
    assert dcp_view(tmp_path / "b") == dcp_view(dcp_original)


def test_dcp_corrupt_frame_is_a_protocol_error(dcp_original):
    with serving("dcp", "--from", str(dcp_original), "--corrupt-at", "100") as port:
        res = run("stream", f"couchbase://127.0.0.1:{port}/default", "--format", "jsonl")
    assert res.returncode == 5, res.stderr
    assert len(res.stderr.strip().splitlines()) >= 1 and "Traceback" not in res.stderr
    assert len([x for x in res.stdout.splitlines() if '"in"' in x]) >= 100


def test_synapse_faults(synapse_original, tmp_path):
    # a broken RDATA row is flagged on that line; the stream goes on
    with serving("synapse", "--from", str(synapse_original), "--corrupt-at", "50") as port:
        res = run("stream", f"synapse://127.0.0.1:{port}", "--max-messages", "120", "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    bad = [r for r in rows if r.get("decode_error")]
    assert len(bad) == 1 and bad[0]["command"] == "RDATA" and bad[0]["decode_error"].startswith("row:")
    # a disconnect: the client reconnects and gets the rest, after a POSITION for each stream
    want = [raw for c, raw in synapse_view(synapse_original) if c == "RDATA"]
    with serving("synapse", "--from", str(synapse_original), "--disconnect-at", "100") as port:
        summary = capture(f"synapse://127.0.0.1:{port}", tmp_path / "d", "--max-messages", str(len(want) + 30))
    assert summary["connections"] >= 2
    got = [raw for c, raw in synapse_view(tmp_path / "d") if c == "RDATA"]
    assert got == want


def test_unreadable_capture_is_one_line_exit_1(tmp_path):
    bad = tmp_path / "dcp-bad.parquet"
    bad.write_bytes(b"not parquet at all")
    for proto in ("dcp", "synapse"):
        res = run("serve", proto, "--from", str(bad), "--port", "0", timeout=30)
        assert res.returncode == 1
        assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    res = run("serve", "dcp", "--pace", "2", "--port", "0", timeout=30)
    assert res.returncode == 2


# --------------------------------------------------------------------------- pacing (fake clock)

def _stream(frames: list[bytes], monos: list[int], request) -> RecordedStream:
    offs = np.cumsum([0] + [len(f) for f in frames]).astype(np.int64)
    ops = np.array([f[1] for f in frames], np.uint8)
    seq = np.array([int.from_bytes(f[24:32], "big") if f[1] == 0x57 else -1 for f in frames], np.int64)
    snap = np.array([1 if f[1] == 0x56 else -1 for f in frames], np.int64)
    return RecordedStream(vbucket=0, conn=0, request=request, status=0, failover_log=((77, 0),), resp_mono=0,
                          data=b"".join(frames), offsets=offs, mono=np.array(monos, np.int64),
                          order=np.arange(len(frames), dtype=np.int64), opcode=ops, seqno=seq, snap_start=snap,
                          ended_by="end")


def _paced_connection(pace, faults=None):
    frames = [m.encode(m.SnapshotMarker(vbucket=0, snap_start=1, snap_end=3, snap_flags=1))]
    frames += [m.encode(m.Mutation(vbucket=0, key=b"k%d" % i, value=b"{}", by_seqno=i, rev_seqno=1, cas=i))
               for i in (1, 2, 3)]
    frames.append(m.encode(m.StreamEnd(vbucket=0, reason=0)))
    monos = [10**9, 2 * 10**9, 4 * 10**9, 7 * 10**9, 7 * 10**9]       # gaps 1s, 2s, 3s, 0
    request = (0, 0, 3, 0, 0, 0)
    rec = DcpRecording(bucket="default", streams={0: [_stream(frames, monos, request)]}, vb_seqnos=[{0: 3}])
    model = PlaybackModel(rec, pace=pace, faults=faults)
    conn = model.connect(0.0)
    for msg in (m.SelectBucket(bucket=b"default"), m.DcpOpen(name=b"t", flags=1),
                m.StreamRequest(vbucket=0, opaque=9, start_seqno=0, end_seqno=3)):
        conn.receive(m.encode(msg), 0.0)
    return conn


def _served(conn, times):
    """(time, opcode) of every stream frame pulled at each fake time."""
    out = []
    for t in times:
        for chunk in conn.pull(t):
            for off, ln in _split(bytes(chunk)):
                fr = bytes(chunk)[off:off + ln]
                if fr[0] == 0x80 or fr[0] == 0x00:
                    out.append((t, fr[1], int.from_bytes(fr[12:16], "big"), fr[0]))
    return out


def _split(buf):
    pos = 0
    while pos < len(buf):
        ln = 24 + int.from_bytes(buf[pos + 8:pos + 12], "big")
        yield pos, ln
        pos += ln


def test_pace_original_keeps_recorded_gaps_and_order():
    times = [x / 4 for x in range(0, 40)]
    got = _served(_paced_connection(1.0), times)
    assert [op for _, op, _, _ in got] == [0x56, 0x57, 0x57, 0x57, 0x55]
    assert all(opq == 9 for _, _, opq, _ in got)
    sent = [t for t, *_ in got]
    assert sent == sorted(sent)
    gaps = np.diff(sent)
    assert list(gaps[:3]) >= [1.0, 2.0, 3.0] and all(g >= r for g, r in zip(gaps, [1.0, 2.0, 3.0]))
    # twice as fast: half the gaps; max: everything at once, same frames in the same order
    fast = [t for t, *_ in _served(_paced_connection(2.0), times)]
    assert all(g >= r for g, r in zip(np.diff(fast), [0.5, 1.0, 1.5]))
    at_once = _served(_paced_connection(None), [0.0])
    assert [op for _, op, _, _ in at_once] == [op for _, op, _, _ in got] and {t for t, *_ in at_once} == {0.0}


def test_stall_and_corrupt_sans_io():
    conn = _paced_connection(None, Faults(stall_at=2, stall_seconds=5.0, corrupt_at=3))
    first = _served(conn, [0.0, 1.0, 4.9])
    assert [op for _, op, _, _ in first] == [0x56, 0x57]       # nothing during the stall
    assert conn.next_deadline() == pytest.approx(5.0)
    rest = _served(conn, [5.0])
    assert [(op, magic) for _, op, _, magic in rest] == [(0x57, 0x80), (0x57, 0x00), (0x55, 0x80)]


def test_synapse_pace_original_fake_clock():
    lines = [b"POSITION events master 1 1", b'RDATA events master 2 ["a"]', b'RDATA events master 3 ["b"]']
    feed = PlaybackFeed([(lines, [0, 10**9, 3 * 10**9])], pace=1.0, faults=LineFaults(corrupt_at=2))
    s = PlaybackSession(feed, "localhost")
    s.connect(0.0)
    s.receive([b"REPLICATE"], 0.0)
    got = []
    for t in [x / 2 for x in range(10)]:
        out, close = s.pull(t)
        got += [(t, x) for x in out]
        assert not close
    assert [x for _, x in got] == [lines[0], lines[1], b'RDATA events master 3 ["b"']
    assert [t for t, _ in got] == [0.0, 1.0, 3.0]
