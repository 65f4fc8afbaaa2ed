"""Benchmark (not a test): `serve dcp --from CAPTURE --pace max` against `serve dcp`'s own rate.

Builds a capture of N items from the generated producer (`dcptool capture`), then drains
the same streams (every vbucket from 0 to the high seqno) with one bare client (raw socket,
frames walked by their header, no decoding) from (a) the generated producer and (b) the
playback of that capture, both in-process on their own thread (ThreadedServer), best of
--runs each, and prints frames/s and the ratio playback / serve dcp.

    .venv/bin/python tests/bench/bench_playback.py --items 1000000
"""

from __future__ import annotations

import argparse
import socket
import struct
import subprocess
import tempfile
import time

import _repo  # noqa: F401  (the repository root on sys.path: tests/bench/_repo.py)

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.recorded_producer import PlaybackModel
from dcptool.protocol.dcp.wire import messages as m
from dcptool.replay.playback_source import load_dcp
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

_HDR = struct.Struct(">BB6xI")


def drain(port: int, vbuckets: int) -> tuple[int, float]:
    """Stream every vbucket to its end; (stream frames, seconds)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        reqs = [m.SelectBucket(bucket=b"default", opaque=1), m.DcpOpen(name=b"bench", flags=1, opaque=2)]
        reqs += [m.StreamRequest(vbucket=vb, opaque=100 + vb, flags=4, start_seqno=0) for vb in range(vbuckets)]
        t0 = time.perf_counter()
        s.sendall(b"".join(m.encode(r) for r in reqs))
        buf = bytearray()
        pos = frames = ends = 0
        while ends < vbuckets:
            chunk = s.recv(4 << 20)
            if not chunk:
                raise SystemExit("server closed the connection")
            buf += chunk
            n = len(buf)
            while pos + 24 <= n:
                magic, op, body = _HDR.unpack_from(buf, pos)
                if pos + 24 + body > n:
                    break
                if magic == 0x80:
                    frames += 1
                    if op == 0x55:
                        ends += 1
                pos += 24 + body
            if pos > (1 << 24):
                del buf[:pos]
                pos = 0
        return frames, time.perf_counter() - t0


def best(port: int, vbuckets: int, runs: int) -> tuple[int, float]:
    results = [drain(port, vbuckets) for _ in range(runs)]
    return min(results, key=lambda r: r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--vbuckets", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    model = P.server_from_options(vbuckets=args.vbuckets, items=args.items, seed=1, checkpoint_items=100)
    with tempfile.TemporaryDirectory() as tmp, ThreadedServer(model) as gen:
        t = time.perf_counter()
        res = subprocess.run([DCPTOOL, "capture", f"couchbase://127.0.0.1:{gen.port}/default", "-o", tmp,
                              "--quiet"], capture_output=True, text=True)
        if res.returncode:
            raise SystemExit(res.stderr)
        print(f"capture of {args.items} items: {time.perf_counter() - t:.1f}s")
        t = time.perf_counter()
        recording = load_dcp([tmp])
        print(f"load for playback: {recording.frames} frames in {time.perf_counter() - t:.2f}s")
        base_frames, base_s = best(gen.port, args.vbuckets, args.runs)
        with ThreadedServer(PlaybackModel(recording)) as play:
            play_frames, play_s = best(play.port, args.vbuckets, args.runs)
    assert play_frames == base_frames, (play_frames, base_frames)
    base_rate, play_rate = base_frames / base_s, play_frames / play_s
    print(f"serve dcp (generated):   {base_frames} frames {base_s:.3f}s  {base_rate:,.0f} frames/s")
    print(f"serve dcp --from --pace max: {play_frames} frames {play_s:.3f}s  {play_rate:,.0f} frames/s")
    print(f"ratio playback / serve dcp: {play_rate / base_rate:.2f}x")


if __name__ == "__main__":
    main()
