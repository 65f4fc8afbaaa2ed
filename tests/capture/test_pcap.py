"""Issue 28: captures out as packets (`dcptool export`) and packets in as captures
(`dcptool import`): round trips, Wireshark's couchbase dissector over an export, a real
tcpdump of a session imported to the same documents as dcptool's own capture of it,
hostile packet files, and the downstream commands on an imported capture."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from dcptool.protocol.dcp.wire import messages as M
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support import capgen
from tests.support.cli_util import error_line, run
from tests.support.pcap_session import (
    ACK,
    FIN,
    PSH,
    Server,
    Tcpdump,
    handshake,
    require_tcpdump,
    write_flow,
)
from tests.support.synapse_env import RedisServer
from tests.support.tshark_util import _flat, require_tshark

COLS = ["conn", "direction", "raw", "ts"]
# where and when a frame was recorded: a capture's own id, when each side saw the bytes, and the
# frame's place among both directions. dcptool's capture puts a request it sends (a lag poll, a
# buffer ack) where its event loop sent it among the frames it has read; the wire, and so the
# import, where the kernel put the packet among those that had arrived: the same bytes each way,
# interleaved differently from run to run (the first lag poll goes out as the streams open)
PROVENANCE = ("capture_id", "ts", "frame_no")
SECRET = "pw-Zq8!in-the-packets-never-in-a-capture"


def rows(path, cols=COLS):
    return read_capture_table(find_captures([str(path)]), cols).to_pylist()


def each_way(path) -> dict[str, list[bytes]]:
    """The frames of a capture in order, each direction apart (see PROVENANCE)."""
    out: dict[str, list[bytes]] = {"in": [], "out": []}
    for r in rows(path):
        out[r["direction"]].append(r["raw"])
    return out


def assert_same_frames_each_way(own, imported) -> None:
    """Both captures hold the same frames in the same order in each direction, and some each way."""
    mine, wire = each_way(own), each_way(imported)
    for way in ("in", "out"):
        same = wire[way] == mine[way]
        assert same and mine[way], f"{way}: {first_difference(wire[way], mine[way])}"


def first_difference(a: list, b: list) -> str:
    """Where two long lists part, in one line (pytest's own diff of 3,000 documents with
    their bodies takes longer than a CI run)."""
    if len(a) != len(b):
        return f"{len(a)} against {len(b)} entries"
    i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    if isinstance(a[i], dict):
        keys = sorted(k for k in a[i].keys() | b[i].keys() if a[i].get(k) != b[i].get(k))
        return f"entry {i} differs in {keys}"
    return f"entry {i} differs"


def documents(path) -> list[dict]:
    res = run("replay", str(path), "--table", "documents", "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    return [{k: v for k, v in json.loads(line).items() if k not in PROVENANCE} for line in res.stdout.splitlines()]


@pytest.fixture(scope="module")
def dcp_session(tmp_path_factory):
    """A real session: tcpdump on lo around `dcptool capture` of `serve dcp`."""
    require_tcpdump()
    d = tmp_path_factory.mktemp("dcp")
    old = os.environ.get("DCPTOOL_PASSWORD")
    os.environ["DCPTOOL_PASSWORD"] = SECRET      # the server's and the client's (never in argv)
    try:
        srv = Server("dcp", "--items", "3000", "--vbuckets", "8", "--seed", "7", "--user", "alice")
        try:
            dump = Tcpdump(str(d / "session.pcap"), srv.port)
            res = run("capture", f"couchbase://{srv.address}/default", "-o", str(d / "own"), "--quiet",
                      "--user", "alice", "--sasl-plain")
            dump.stop_after_close()
        finally:
            srv.stop()
    finally:
        if old is None:
            os.environ.pop("DCPTOOL_PASSWORD", None)
        else:
            os.environ["DCPTOOL_PASSWORD"] = old
    assert res.returncode == 0, res.stderr
    return d, srv.port


# -- round trips

@pytest.mark.parametrize("suffix", [".pcapng", ".pcap"])
def test_synapse_capture_round_trips_through_packets(tmp_path, suffix):
    capgen.write_captures(capgen.generate("synapse", 11, 300, max_captures=1), str(tmp_path / "cap"), seed=11)
    res = run("export", str(tmp_path / "cap"), "-o", str(tmp_path / f"x{suffix}"))
    assert res.returncode == 0, res.stderr
    res = run("import", str(tmp_path / f"x{suffix}"), "-o", str(tmp_path / "back"))
    assert res.returncode == 0, res.stderr
    before, after = rows(tmp_path / "cap"), rows(tmp_path / "back")
    assert [(r["direction"], r["raw"], r["ts"]) for r in after] == [(r["direction"], r["raw"], r["ts"]) for r in before]
    # one conn per TCP connection, numbered as they appear, as the original's were
    first = {}
    for r, o in zip(after, before):
        assert first.setdefault(o["conn"], r["conn"]) == r["conn"]
    assert len(set(first.values())) == len(first) > 1


def test_dcp_capture_round_trips_and_metadata_names_the_file(tmp_path, dcp_session):
    d, port = dcp_session
    res = run("export", str(d / "own"), "-o", str(tmp_path / "x.pcapng"), "--mss", "1000")
    assert res.returncode == 0, res.stderr
    res = run("import", str(tmp_path / "x.pcapng"), "-o", str(tmp_path / "back"), "--port", str(port))
    assert res.returncode == 0, res.stderr
    before, after = rows(d / "own"), rows(tmp_path / "back")
    assert len(after) == len(before) > 3000
    assert [(r["direction"], r["raw"], r["ts"]) for r in after] == [(r["direction"], r["raw"], r["ts"]) for r in before]
    f = find_captures([str(tmp_path / "back")])[0]
    assert json.loads(f.metadata["dcptool.imported_from"]) == {"file": "x.pcapng", "format": "pcapng"}
    node = pq.read_table(f.path, columns=["node"]).column("node").unique().to_pylist()
    assert node == [f"127.0.0.1:{port}"]


def test_tshark_decodes_every_exported_frame_as_one_couchbase_pdu(tmp_path, dcp_session):
    exe = require_tshark()
    d, port = dcp_session
    assert run("export", str(d / "own"), "-o", str(tmp_path / "x.pcapng"), "--mss", "1400").returncode == 0
    out = subprocess.run([exe, "-r", str(tmp_path / "x.pcapng"), "-d", f"tcp.port=={port},couchbase",
                          "-o", "tcp.desegment_tcp_streams:TRUE", "-T", "json", "--no-duplicate-keys",
                          "-J", "couchbase"], capture_output=True, timeout=300, check=True)
    pdus = []
    for pkt in json.loads(out.stdout):
        layer = pkt["_source"]["layers"].get("couchbase")
        if layer is not None:      # several PDUs of one packet come as a list
            pdus += [_flat(one, {}) for one in (layer if isinstance(layer, list) else [layer])]
    frames = rows(d / "own", ["raw"])
    assert len(pdus) == len(frames)
    seqnos = 0
    for pdu, f in zip(pdus, frames):
        row = M.to_row(M.decode_bytes(f["raw"]))
        assert int(pdu["couchbase.magic"], 16) == f["raw"][0]
        assert int(pdu["couchbase.opcode"], 16) == row["opcode"]
        assert int(pdu["couchbase.total_bodylength"]) == len(f["raw"]) - 24
        if f["raw"][0] == 0x80:
            assert int(pdu["couchbase.vbucket"]) == row["vbucket"]
        if row.get("by_seqno") is not None:
            assert int(pdu.get("couchbase.extras.by_seqno", -1)) == row["by_seqno"], (row["op"], {k: v for k, v in pdu.items() if "extras" in k})
            seqnos += 1
    assert seqnos >= 3000


# -- a real tcpdump

def test_tcpdump_of_a_dcp_session_imports_to_the_same_documents(tmp_path, dcp_session):
    d, port = dcp_session
    res = run("import", str(d / "session.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0, res.stderr
    assert "imported 3,0" in res.stderr and "warning" not in res.stderr
    own, imp = documents(d / "own"), documents(tmp_path / "imp")
    same = imp == own
    assert len(own) == 3000 and same, first_difference(imp, own)
    assert_same_frames_each_way(d / "own", tmp_path / "imp")


def _table(path, name) -> list[dict]:
    res = run("replay", str(path), "--table", name, "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    return [{k: v for k, v in json.loads(line).items() if k not in ("capture_id", "frame_no") and "ts" not in k}
            for line in res.stdout.splitlines()]


def test_tcpdump_of_a_synapse_tcp_session_imports_to_the_same_rows(tmp_path):
    require_tcpdump()
    srv = Server("synapse", "--server-name", "pcap.test", "--items", "150", "--seed", "3")
    try:
        dump = Tcpdump(str(tmp_path / "s.pcap"), srv.port)
        # the server sends its 150 lines at once and then only pings: a few seconds hold them all
        res = run("capture", f"synapse://{srv.address}", "-o", str(tmp_path / "own"), "--quiet",
                  "--duration", "4")
        dump.stop_after_close()
    finally:
        srv.stop()
    assert res.returncode == 0, res.stderr
    res = run("import", str(tmp_path / "s.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    own, imp = rows(tmp_path / "own", ["direction", "raw"]), rows(tmp_path / "imp", ["direction", "raw"])
    # the client writes its first lines before SERVER arrives, so the two directions
    # interleave differently on the wire; each direction is the same, in order
    for way in ("in", "out"):
        assert [r["raw"] for r in imp if r["direction"] == way] == [r["raw"] for r in own if r["direction"] == way]
    for name in ("rows", "positions"):
        mine = _table(tmp_path / "own", name)
        assert _table(tmp_path / "imp", name) == mine and mine, name
    assert len(_table(tmp_path / "own", "rows")) >= 150


# -- hostile packet files

def _frame(opcode: int, vb: int, key: bytes, value: bytes = b"", magic: int = 0x80) -> bytes:
    return struct.pack(">BBHBBHIIQ", magic, opcode, len(key), 0, 0, vb, len(key) + len(value), 7, 0) + key + value


FRAMES = [_frame(0x01, i % 4, b"key-%03d" % i, b"v" * (40 + i)) for i in range(12)]


def _session(lost=None, swap=None, repeat=None):
    """The client sends FRAMES one per segment; `lost`: the index of a segment the capture
    lost; `swap`: that segment comes after the next; `repeat`: that one is sent twice."""
    pkts = handshake()
    off, ts = 1, 1_700_000_000_000_000_000
    segs = []
    for i, f in enumerate(FRAMES):
        segs.append((ts + i * 1000, True, off, None if i == lost else PSH | ACK, f))
        off += len(f)
    if swap is not None:
        segs[swap], segs[swap + 1] = segs[swap + 1], segs[swap]
    if repeat is not None:
        segs.insert(repeat + 1, segs[repeat])
    pkts += segs
    pkts += [(ts + 99_000, False, 1, ACK, b""), (ts + 99_000, True, off, FIN | ACK, b""),
             (ts + 99_000, False, 1, FIN | ACK, b"")]
    return pkts


def test_lost_segment_flags_the_frames_around_it_and_exits_0_with_a_warning(tmp_path):
    write_flow(str(tmp_path / "lost.pcap"), _session(lost=5))
    res = run("import", str(tmp_path / "lost.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0, res.stderr
    assert "warning: 1 hole(s) of " in res.stderr and "Traceback" not in res.stderr
    got = rows(tmp_path / "imp", ["raw", "decode_error"])
    whole = [r["raw"] for r in got if r["decode_error"] is None]
    assert whole == FRAMES[:5] + FRAMES[6:]       # nothing guessed, nothing else lost
    assert all(r["raw"] not in FRAMES for r in got if r["decode_error"] is not None)


def test_a_hole_inside_a_frame_leaves_its_pieces_flagged(tmp_path):
    pkts = handshake()
    data = b"".join(FRAMES)
    ts = 1_700_000_000_000_000_000
    cut = [0, 100, 180, 260, len(data)]          # the segment 180..260 is lost, mid-frame
    for i in range(4):
        pkts.append((ts + i, True, 1 + cut[i], None if i == 2 else PSH | ACK, data[cut[i]:cut[i + 1]]))
    pkts.append((ts + 9, False, 1, ACK, b""))
    write_flow(str(tmp_path / "mid.pcap"), pkts)
    res = run("import", str(tmp_path / "mid.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0, res.stderr
    got = rows(tmp_path / "imp", ["raw", "decode_error"])
    flagged = [r for r in got if r["decode_error"] is not None]
    assert len(flagged) == 2 and "lost by the capture" in flagged[0]["decode_error"]
    assert b"".join(r["raw"] for r in got) == data[:180] + data[260:]
    assert [r["raw"] for r in got if r["decode_error"] is None] == [f for f in FRAMES if data.find(f) + len(f) <= 180
                                                                      or data.find(f) >= 260]


@pytest.mark.parametrize("kind", ["swap", "repeat"])
def test_out_of_order_and_retransmitted_segments_reassemble(tmp_path, kind):
    write_flow(str(tmp_path / "f.pcapng"), _session(**{kind: 3}), kind="pcapng")
    res = run("import", str(tmp_path / "f.pcapng"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    got = rows(tmp_path / "imp", ["raw", "decode_error", "direction", "conn"])
    assert [r["raw"] for r in got] == FRAMES
    assert {(r["decode_error"], r["direction"], r["conn"]) for r in got} == {(None, "out", 1)}


def test_truncated_file_imports_what_came_before_with_a_warning(tmp_path):
    write_flow(str(tmp_path / "t.pcap"), _session())
    data = (tmp_path / "t.pcap").read_bytes()
    (tmp_path / "t.pcap").write_bytes(data[:len(data) - 300])      # cut inside the last data packets
    res = run("import", str(tmp_path / "t.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0, res.stderr
    assert "cut short inside a packet record" in res.stderr
    got = rows(tmp_path / "imp", ["raw", "decode_error"])
    assert [r["raw"] for r in got if r["decode_error"] is None] == FRAMES[:len(got)]
    assert 0 < len(got) < len(FRAMES)


def test_not_a_packet_file_exits_2_and_nothing_decodable_exits_5(tmp_path):
    (tmp_path / "x.pcap").write_bytes(b"hello, this is text\n")
    res = run("import", str(tmp_path / "x.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 2 and "not a pcap or pcapng file" in error_line(res)
    pkts = handshake() + [(1, True, 1, PSH | ACK, b"\x16\x03\x01\x00\x05hello")]   # a TLS ClientHello
    write_flow(str(tmp_path / "tls.pcap"), pkts)
    res = run("import", str(tmp_path / "tls.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 5 and "Traceback" not in res.stderr
    assert "nothing to import" in res.stderr.splitlines()[-1] and "1 tls" in res.stderr.splitlines()[-1]
    assert "skipped a TLS connection (encrypted): 127.0.0.1:40001 -> 127.0.0.1:11210" in res.stderr
    assert not os.path.exists(tmp_path / "imp") or not os.listdir(tmp_path / "imp")


def test_a_flow_that_began_before_the_capture_is_decoded_from_the_first_whole_frame(tmp_path):
    data = b"".join(FRAMES)
    start = data.find(FRAMES[2]) - 30      # the capture starts 30 bytes before frame 2
    ts = 1_700_000_000_000_000_000
    pkts = [(ts, True, 1 + start, PSH | ACK, data[start:start + 200]),
            (ts + 1, True, 1 + start + 200, PSH | ACK, data[start + 200:])]
    write_flow(str(tmp_path / "m.pcap"), pkts)
    res = run("import", str(tmp_path / "m.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0 and "began before the capture" in res.stderr, res.stderr
    got = rows(tmp_path / "imp", ["raw", "decode_error"])
    assert got[0]["raw"] == data[start:start + 30] and "mid-stream" in got[0]["decode_error"]
    assert [r["raw"] for r in got[1:]] == FRAMES[2:]


# -- downstream commands on an imported capture

@pytest.fixture(scope="module")
def imported(dcp_session, tmp_path_factory):
    d, _port = dcp_session
    out = tmp_path_factory.mktemp("imported") / "imp"
    res = run("import", str(d / "session.pcap"), "-o", str(out))
    assert res.returncode == 0, res.stderr
    return out


def test_a_sasl_plain_password_on_the_wire_is_masked_in_the_import(tmp_path):
    auth = _frame(0x21, 0, b"PLAIN", b"\x00alice\x00" + SECRET.encode())
    ts = 1_700_000_000_000_000_000
    pkts = handshake(ts) + [(ts + 1, True, 1, PSH | ACK, auth), (ts + 2, True, 1 + len(auth), PSH | ACK, FRAMES[0])]
    write_flow(str(tmp_path / "sasl.pcap"), pkts)
    assert SECRET.encode() in (tmp_path / "sasl.pcap").read_bytes()      # it crossed the wire
    res = run("import", str(tmp_path / "sasl.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0, res.stderr
    for name in os.listdir(tmp_path / "imp"):
        assert SECRET.encode() not in (tmp_path / "imp" / name).read_bytes()
    got = rows(tmp_path / "imp", ["op", "raw"])
    assert got[0]["op"] == "sasl_auth" and got[1]["raw"] == FRAMES[0] and len(got) == 2


def test_inspect_an_imported_capture(imported):
    res = run("inspect", str(imported), "--json")
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout)
    assert summary["protocol"] == "dcp" and summary["rows"] > 3000
    assert summary["ops"]["mutation"] == 3000


def test_verify_an_imported_capture(imported):
    res = run("verify", str(imported))
    assert res.returncode == 0, res.stdout + res.stderr


def test_replay_an_imported_capture_checksums_like_its_documents(imported):
    res = run("replay", str(imported), "--table", "documents", "--checksum")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[1] == "documents" and len(res.stdout.split()[0]) == 64


# -- reassembly, property-based

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dcptool.capture.pcap import tcp  # noqa: E402,I001


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.binary(min_size=1, max_size=3000), st.integers(0, 2**32 - 1), st.randoms(use_true_random=False))
def test_reassembly_gives_the_stream_back_whatever_the_segment_order(data, isn, rnd):
    """Segments cut anywhere, overlapping, duplicated and shuffled (sequence numbers
    wrapping around 2^32) give the stream back in order, nothing lost or doubled."""
    cuts = sorted(rnd.sample(range(1, len(data)), min(len(data) - 1, rnd.randint(0, 12)))) if len(data) > 1 else []
    bounds = [0, *cuts, len(data)]
    segs = []
    for a, b in zip(bounds, bounds[1:]):
        a2 = max(0, a - rnd.randint(0, 5))      # overlapping the segment before
        segs.append((a2, data[a2:b]))
    segs += rnd.sample(segs, min(len(segs), 3))  # retransmissions
    first = segs[0]
    rest = segs[1:]
    rnd.shuffle(rest)
    d = tcp.Direction()
    d.syn((isn - 1) & 0xFFFFFFFF)
    out: list = []
    for off, payload in [first, *rest]:
        d.segment((isn + off) & 0xFFFFFFFF, payload, out)
    d.finish(out)
    assert all(kind == tcp.DATA for kind, _ in out)
    assert b"".join(x for _, x in out) == data
    assert d.gaps == 0


def test_a_hole_acknowledged_by_the_peer_is_lost_at_once():
    d = tcp.Direction()
    d.syn(99)
    out: list = []
    d.segment(100, b"abc", out)
    d.segment(110, b"klm", out)          # 103..110 never captured
    assert out == [(tcp.DATA, b"abc")]
    d.acked(113, out)                    # the receiver got everything: the hole is lost
    assert out[1:] == [(tcp.GAP, 7), (tcp.DATA, b"klm")]
    d.fin(113, 0)
    d.acked(114, out)                    # the FIN's own sequence number is no hole
    assert len(out) == 3 and d.lost_bytes == 7


def test_bytes_waiting_behind_holes_stay_under_the_pool_limit(tmp_path):
    """A one-sided capture (no ACK ever shows a hole lost): the bytes held behind the hole
    are bounded by the import's pool, the hole given up early, the frames after it kept."""
    from dcptool.capture.pcap.importer import Importer
    pkts, off = handshake(), 1
    for i, f in enumerate(FRAMES):
        pkts.append((1_700_000_000_000_000_000 + i, True, off, None if i == 2 else PSH | ACK, f))
        off += len(f)
    write_flow(str(tmp_path / "one-sided.pcap"), pkts)
    imp = Importer(str(tmp_path / "one-sided.pcap"), str(tmp_path / "imp"), {11210}, lambda text: None,
                   pending_limit=200)
    res = imp.run()
    assert imp.pool.peak <= 200 + max(map(len, FRAMES)) and imp.pool.bytes == 0
    assert res.gaps == 1 and res.lost_bytes == len(FRAMES[2])
    got = rows(tmp_path / "imp", ["raw", "decode_error"])
    assert [r["raw"] for r in got if r["decode_error"] is None] == FRAMES[:2] + FRAMES[3:]


def _resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


def test_redis_pub_sub_of_synapse_imports_as_lines_with_their_channel_and_no_credentials(tmp_path):
    secret = b"pw-never-in-a-capture"
    ts = 1_700_000_000_000_000_000
    client = [_resp(b"AUTH", b"bob", secret), _resp(b"SUBSCRIBE", b"hs", b"hs/USER_IP"),
              _resp(b"PUBLISH", b"hs", b"NAME worker1"), _resp(b"PUBLISH", b"hs", b"REPLICATE")]
    server = [b"+OK\r\n", b"+PONG\r\n", b"*3\r\n$9\r\nsubscribe\r\n$2\r\nhs\r\n:1\r\n",
              b":1\r\n", _resp(b"message", b"hs", b"POSITION events master 5 5"),
              _resp(b"message", b"hs", b"RDATA events master 6 " + b'["e", {"k": 1}]')]
    pkts, off_c, off_s = handshake(ts), 1, 1
    for i, (c, s) in enumerate(zip(client + [b""] * 2, server)):
        if c:
            pkts.append((ts + 2 * i, True, off_c, PSH | ACK, c))
            off_c += len(c)
        # the server's last message is split over two segments
        for part in ([s[:20], s[20:]] if i == len(server) - 1 else [s]):
            pkts.append((ts + 2 * i + 1, False, off_s, PSH | ACK, part))
            off_s += len(part)
    write_flow(str(tmp_path / "r.pcap"), pkts, port=6379)
    res = run("import", str(tmp_path / "r.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0, res.stderr
    got = rows(tmp_path / "imp", ["direction", "raw", "channel", "decode_error", "command"])
    assert [(r["direction"], r["channel"], r["raw"]) for r in got] == [
        ("out", "hs", b"NAME worker1"), ("out", "hs", b"REPLICATE"),
        ("in", "hs", b"POSITION events master 5 5"), ("in", "hs", b'RDATA events master 6 ["e", {"k": 1}]')]
    assert [r["command"] for r in got] == ["NAME", "REPLICATE", "POSITION", "RDATA"]
    for name in os.listdir(tmp_path / "imp"):
        assert secret not in (tmp_path / "imp" / name).read_bytes()


IN_LINES = 1 + 52   # the client's own REPLICATE echoed on the channel, and the 52 lines published


def test_tcpdump_of_a_redis_session_imports_to_the_same_rows(tmp_path):
    """tcpdump of `capture synapse+redis://` imports to the rows the capture itself recorded.
    The capture stops at its IN_LINES-th received line (the last one published), not after a
    fixed duration."""
    require_tcpdump()
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (run scripts/setup.sh --test)")
    redis_srv = RedisServer(tmp_path)
    try:
        dump = Tcpdump(str(tmp_path / "r.pcap"), redis_srv.port)
        cap = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "dcptool"), "capture",
                                f"synapse+redis://127.0.0.1:{redis_srv.port}?server_name=hs", "-o",
                                str(tmp_path / "own"), "--quiet", "--json", "--max-messages", str(IN_LINES),
                                "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        pub = redis_srv.client()
        deadline = time.monotonic() + 30
        while pub.pubsub_numsub("hs")[0][1] < 1 and time.monotonic() < deadline:   # bounded wait: subscribed
            time.sleep(0.05)
        pub.publish("hs", "SERVER hs")
        pub.publish("hs", "POSITION events master 1 1")
        for tok in range(2, 52):
            pub.publish("hs", f'RDATA events master {tok} ["ev", {{"k": {tok}}}]')
        pub.close()
        assert cap.wait(90) == 0, cap.stderr.read().decode()
        assert json.loads(cap.stdout.read())["stopped"] == "max-messages"   # not the --duration bound
        cap.stdout.close()
        cap.stderr.close()
        dump.stop_after_close(connections=3)
    finally:
        redis_srv.stop()
    res = run("import", str(tmp_path / "r.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0 and "warning" not in res.stderr, res.stderr
    cols = ["direction", "raw", "channel"]
    own, imp = rows(tmp_path / "own", cols), rows(tmp_path / "imp", cols)
    assert [r for r in imp if r["direction"] == "in"] == [r for r in own if r["direction"] == "in"]
    # the 52 lines published, and the client's own lines echoed back on the channel
    assert sum(r["raw"].startswith(b"RDATA ") for r in own if r["direction"] == "in") == 50
    # the client's own PUBLISHes are there (and the test's, from its own connection)
    mine = [r for r in own if r["direction"] == "out"]
    assert mine and all(r in [x for x in imp if x["direction"] == "out"] for r in mine)
    for name in ("rows", "positions"):
        assert _table(tmp_path / "imp", name) == _table(tmp_path / "own", name), name


def test_diff_of_dcptools_own_capture_and_the_tcpdump_import_finds_nothing(imported, dcp_session):
    d, _port = dcp_session
    res = run("diff", str(d / "own"), str(imported))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 added, 0 changed, 0 removed (3000 -> 3000 documents)" in res.stdout + res.stderr


def test_tcpdumps_pcap_converted_to_pcapng_by_editcap_imports_the_same(tmp_path, dcp_session):
    exe = shutil.which("editcap")
    if exe is None:
        pytest.skip("editcap is not installed (Debian package wireshark-common, with tshark)")
    d, _port = dcp_session
    subprocess.run([exe, "-F", "pcapng", str(d / "session.pcap"), str(tmp_path / "s.pcapng")], check=True, timeout=60)
    res = run("import", str(tmp_path / "s.pcapng"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 0, res.stderr
    imp, own = documents(tmp_path / "imp"), documents(d / "own")
    same = imp == own
    assert same and own, first_difference(imp, own)
    assert_same_frames_each_way(d / "own", tmp_path / "imp")


@pytest.mark.parametrize("link", ["ethernet", "vlan", "sll", "sll2", "null", "raw6"])
def test_tcp_segments_are_found_under_every_link_type_tcpdump_writes(link):
    from dcptool.capture.pcap.packets import parse, tcp_packet
    ip4 = tcp_packet(bytes([10, 0, 0, 1]), 40001, bytes([10, 0, 0, 2]), 11210, 7, 9, PSH | ACK, b"payload")
    tcp_part = ip4[20:]
    ip6 = (bytes([0x60, 0, 0, 0]) + struct.pack(">HBB", len(tcp_part), 6, 64) + bytes(15) + b"\x01"
           + bytes(15) + b"\x02" + tcp_part)
    frames = {
        "ethernet": (1, bytes(12) + b"\x08\x00" + ip4 + b"\x00" * 6),     # with Ethernet padding
        "vlan": (1, bytes(12) + b"\x81\x00\x00\x05\x08\x00" + ip4),
        "sll": (113, bytes(14) + b"\x08\x00" + ip4),
        "sll2": (276, b"\x08\x00" + bytes(18) + ip4),
        "null": (0, struct.pack("=I", 2) + ip4),
        "raw6": (101, ip6),
    }
    linktype, data = frames[link]
    seg = parse(linktype, data)
    assert seg is not None and seg.payload == b"payload" and (seg.seq, seg.ack) == (7, 9)
    if link == "raw6":
        assert (seg.src, seg.dst) == ("[::1]:40001", "[::2]:11210")
    else:
        assert (seg.src, seg.dst) == ("10.0.0.1:40001", "10.0.0.2:11210")


@pytest.mark.parametrize("link", [1, 113, 276, 0, 101])
def test_headers_read_in_bulk_are_those_read_one_packet_at_a_time(link):
    """parse_batch (numpy over a batch) agrees with parse (one packet) on packets cut
    short, with bytes changed anywhere (versions, lengths, fragments, protocols, offsets)."""
    import random

    import numpy as np

    from dcptool.capture.pcap.packets import addr, parse, parse_batch, tcp_packet
    rnd = random.Random(link)
    ip4 = tcp_packet(bytes([10, 0, 0, 1]), 40001, bytes([10, 0, 0, 2]), 11210, 7, 9, PSH | ACK, b"payload-xyz")
    head = {1: bytes(12) + b"\x08\x00", 113: bytes(14) + b"\x08\x00", 276: b"\x08\x00" + bytes(18),
            0: struct.pack("=I", 2), 101: b""}[link]
    pkts = []
    for _ in range(400):
        p = bytearray(head + ip4 + bytes(rnd.randint(0, 4)))
        for _ in range(rnd.randint(0, 2)):
            p[rnd.randrange(len(p))] = rnd.randrange(256)
        pkts.append(bytes(p[:rnd.randint(0, len(p))]) if rnd.random() < 0.2 else bytes(p))
    lens = np.array([len(p) for p in pkts], np.int64)
    ends = np.cumsum(lens)
    buf = b"".join(pkts)
    bulk, cols = parse_batch(link, buf, ends - lens, ends)
    assert 0 < sum(bulk) < len(pkts)        # both ways taken
    for i, p in enumerate(pkts):
        if bulk[i]:
            src, sport, dst, dport, seq, ack, flags, ps, pe = (c[i] for c in cols)
            seg = parse(link, p)
            assert seg is not None and (addr(src, sport), addr(dst, dport), seq, ack, flags) == seg[:5]
            assert buf[ps:pe] == seg.payload


@pytest.mark.parametrize("runs", [0, 3, 5000])
def test_rows_of_a_flush_are_merged_in_frame_order_as_slices_or_one_take(runs):
    """sinks.in_order gives the rows of its batches in frame_no order, ties in batch order,
    whether whole runs stay slices (few runs) or everything is reordered once (many)."""
    import random

    import numpy as np
    import pyarrow as pa

    from dcptool.capture.pcap.sinks import in_order
    rnd = random.Random(runs)
    if runs:
        keys = sorted(rnd.randrange(runs) for _ in range(6000))
        parts = [sorted(k for k in keys if rnd.random() < 0.5) for _ in range(3)]
    else:       # one batch after the other: a run must not cross from one into the next
        parts = [list(range(0, 100)), list(range(100, 250)), list(range(250, 260))]
    batches = [pa.record_batch({"frame_no": pa.array(p, pa.int64()),
                                "src": pa.array([f"{i}:{j}" for j in range(len(p))])}) for i, p in enumerate(parts)]
    got = pa.Table.from_batches(in_order(batches))
    whole = pa.Table.from_batches(batches)
    want = whole.take(pa.array(np.argsort(whole.column("frame_no").to_numpy(), kind="stable")))
    assert got.to_pydict() == want.to_pydict()
