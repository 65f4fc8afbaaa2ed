"""`dcptool capture couchbase://` end to end over loopback: a whole capture against the
producer, SIGKILL at seeded kill points (frames served) then --resume without a gap, a connection cut
in the middle of a frame, and no credential anywhere in what it writes or logs."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import threading
import time

import pyarrow as pa
import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire.frames import split_until_error
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.live_capture import data_on_disk, served, stop_live_updates
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration
ITEM_OPS = ("mutation", "deletion", "expiration")


def capture(url, outdir, *args, env=None, timeout=120, verbose=False):
    cmd = [DCPTOOL, *(["-v"] if verbose else []), "capture", url, "-o", str(outdir), "--quiet", "--json", *args]
    full_env = dict(os.environ, **(env or {}))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    return res, cmd


def table_of(outdir) -> pa.Table:
    return read_capture_table(find_captures([str(outdir)]))


def items(t: pa.Table) -> dict[int, list[tuple[int, bytes, int]]]:
    """{vb: [(seqno, key, conn)]} of received items, in capture order."""
    out: dict[int, list] = {}
    for r in t.select(["direction", "op", "vbucket", "by_seqno", "key", "conn"]).to_pylist():
        if r["direction"] == "in" and r["op"] in ITEM_OPS:
            out.setdefault(r["vbucket"], []).append((r["by_seqno"], r["key"], r["conn"]))
    return out


def expected(model) -> dict[int, set[tuple[int, bytes]]]:
    return {vb.vbid: {(it.seqno, it.key) for it in vb.items()} for vb in model.buckets["default"].vbuckets
            if vb.high_seqno}


def test_capture_is_complete_masks_sasl_and_leaks_no_secret(tmp_path):
    secret = "pw-Zq8!never-record-me"
    model = P.server_from_options(vbuckets=16, items=3000, seed=3, users={"alice": secret})
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res, cmd = capture(url, tmp_path / "c", "--user", "alice", env={"DCPTOOL_PASSWORD": secret},
                           verbose=True)
    assert res.returncode == 0, res.stderr
    assert secret not in " ".join(cmd)
    summary = json.loads(res.stdout)
    assert summary["rows"] == summary["frames"] > 3000 and summary["connections"] == 1
    t = table_of(tmp_path / "c")
    assert t.num_rows == summary["rows"]
    got = items(t)
    assert {vb: {(s, k) for s, k, _ in v} for vb, v in got.items()} == expected(model)
    for vb, v in got.items():  # every seqno once, in order
        seqnos = [s for s, _, _ in v]
        assert seqnos == sorted(set(seqnos))
    # the SASL exchange was recorded, both directions, with the client's payloads masked
    sasl = [r for r in t.select(["op", "direction", "raw"]).to_pylist() if r["op"] in ("sasl_auth", "sasl_step")]
    outs = [r["raw"] for r in sasl if r["direction"] == "out"]
    assert len(outs) >= 2 and any(r["direction"] == "in" for r in sasl)
    for raw in outs:
        keylen = int.from_bytes(raw[2:4], "big")
        value = raw[24 + raw[4] + keylen:]
        assert value and set(value) == {ord("*")}
    # no secret, no proof, in any file (decompressed), its metadata, or the log
    blob = b"".join(t.column("raw").to_pylist())
    assert secret.encode() not in blob and b"p=" not in b"".join(outs)
    for f in os.listdir(tmp_path / "c"):
        assert secret.encode() not in (tmp_path / "c" / f).read_bytes()
    meta = json.dumps(find_captures([str(tmp_path / "c")])[0].metadata)
    assert secret not in meta and "alice" in meta
    assert secret not in res.stderr and secret not in res.stdout
    opts = json.loads(find_captures([str(tmp_path / "c")])[0].metadata["dcptool.options"])
    assert "hello_features" in opts and "dcp_controls" in opts


def test_sigkill_at_random_moments_then_resume_has_no_gap(tmp_path):
    """Six runs each SIGKILLed at a seeded count of frames (1 to 3,000) after it has rows on
    disk, while the bucket keeps changing, then a last `--resume --to now`: every key's latest
    change is captured, no seqno twice, and the snapshots cover every vbucket from 0 to its
    high seqno. (Each run costs a process start, ~1.5 s: six seeded moments, not ten.)"""
    model = P.server_from_options(vbuckets=8, items=4000, seed=11, checkpoint_items=50)
    rng = random.Random(20261123)
    out = tmp_path / "caps"
    with ThreadedServer(model, rate=4000) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        for _ in range(6):
            before = set(os.listdir(out)) if out.exists() else set()
            resume = ["--resume"] if out.exists() else []   # the first run starts the directory
            p = subprocess.Popen([DCPTOOL, "capture", url, "-o", str(out), *resume, "--to", "forever",
                                  "--quiet", "--noop-interval", "2s"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            data_on_disk(out, before, p)   # this run has rows on disk, then the seeded kill point:
            served(model, model.stream_frames + rng.randrange(1, 3000), p)
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        stop_live_updates(srv)   # the bucket stops changing
        res, _ = capture(url, out, "--resume", "--to", "now")
        assert res.returncode == 0, res.stderr
    t = table_of(out)
    assert len(set(t.column("capture_id").to_pylist())) >= 2
    got = items(t)
    # memory snapshots de-duplicate: what must arrive is every key's latest change, and
    # snapshots that together cover every seqno up to the vbucket's high seqno
    covered = snapshot_cover(t)
    for vbucket in model.buckets["default"].vbuckets:
        vb = vbucket.vbid
        seen = [(s, k) for s, k, _ in got.get(vb, [])]
        latest = {(it.seqno, it.key) for it in vbucket.latest().values()}
        missing = latest - set(seen)
        assert not missing, f"vbucket {vb}: {len(missing)} latest changes never captured, e.g. {sorted(missing)[:3]}"
        seqnos = [s for s, _ in seen]
        assert len(seqnos) == len(set(seqnos)), f"vbucket {vb}: a seqno captured twice without a rollback"
        assert covered.get(vb) == [(0, vbucket.high_seqno)], f"vbucket {vb}: snapshots leave a gap: {covered.get(vb)}"
    rollbacks = [r for r in t.select(["op", "status"]).to_pylist() if r["op"] == "stream_req" and r["status"] == 0x23]
    assert rollbacks == []


def snapshot_cover(t: pa.Table) -> dict[int, list[tuple[int, int]]]:
    """{vb: merged [start, end] ranges} of the snapshot markers received."""
    ranges: dict[int, list] = {}
    for r in t.select(["direction", "op", "vbucket", "snap_start", "snap_end"]).to_pylist():
        if r["direction"] == "in" and r["op"] == "snapshot_marker":
            ranges.setdefault(r["vbucket"], []).append((r["snap_start"], r["snap_end"]))
    out = {}
    for vb, rs in ranges.items():
        merged: list[list[int]] = []
        for a, b in sorted(rs):
            if merged and a <= merged[-1][1] + 1:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out[vb] = [tuple(x) for x in merged]
    return out


class CuttingProxy:
    """Forwards one TCP connection at a time to the producer; the first connection is cut
    in the middle of the `cut_frame`-th frame the producer sends."""

    def __init__(self, upstream, cut_frame: int):
        self.upstream = upstream
        self.cut_frame = cut_frame
        self.cut_done = False
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                down, _ = self.sock.accept()
            except (socket.timeout, OSError):
                continue
            self.connections += 1
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, not self.cut_done), daemon=True).start()

    def _pump(self, src, dst, cutting):
        buf, frames = b"", 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if cutting:
                    already_sent = len(buf)   # the tail kept from before went out already
                    buf += data
                    bounds, consumed, _ = split_until_error(buf)
                    if frames + len(bounds) >= self.cut_frame:
                        off, ln = bounds[self.cut_frame - frames - 1]
                        self.cut_done = True
                        dst.sendall(buf[already_sent:off + ln // 2])   # half of that frame, then nothing
                        break
                    frames += len(bounds)
                    buf = buf[consumed:]
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self):
        self._stop = True
        self.sock.close()


def test_connection_cut_mid_frame_reconnects_and_loses_nothing(tmp_path):
    model = P.server_from_options(vbuckets=8, items=3000, seed=5)
    with ThreadedServer(model) as srv:
        proxy = CuttingProxy((srv.host, srv.port), cut_frame=1500)
        try:
            res, _ = capture(f"couchbase://127.0.0.1:{proxy.port}/default", tmp_path / "c")
        finally:
            proxy.close()
    assert res.returncode == 0, res.stderr
    assert proxy.cut_done and proxy.connections == 2
    t = table_of(tmp_path / "c")
    assert sorted(set(t.column("conn").to_pylist())) == [1, 2]
    assert t.column("decode_error").null_count == t.num_rows
    for raw in t.column("raw").to_pylist():   # every recorded frame is whole
        assert len(raw) == 24 + int.from_bytes(raw[8:12], "big")
    got = items(t)
    assert {vb: {(s, k) for s, k, _ in v} for vb, v in got.items()} == expected(model)
    for vb, v in got.items():
        seqnos = [s for s, _, _ in v]
        assert len(seqnos) == len(set(seqnos))


def test_ctrl_c_finishes_the_segment_and_exits_130(tmp_path):
    model = P.server_from_options(vbuckets=4, items=500, seed=8)
    out = tmp_path / "c"
    with ThreadedServer(model, rate=500) as srv:
        p = subprocess.Popen([DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", str(out),
                              "--to", "forever", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not (out.exists() and any(f.endswith(".arrows") for f in os.listdir(out))):
            assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=30)
    assert p.returncode == 130, err
    names = os.listdir(out)
    assert names and all(n.endswith(".parquet") for n in names), names
    t = table_of(out)
    assert t.num_rows > 500 and "close_stream" in set(t.column("op").to_pylist())
