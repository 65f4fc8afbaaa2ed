"""Capture writer benchmark: one million ~128-byte DCP mutations captured to zstd Parquet.

    .venv/bin/python tests/bench/bench_writer.py [--rows 1000000] [--rss-rows 5000000]

Frames are real wire bytes (one mutation encoded by protocol/dcp/wire/messages.py, tiled with
numpy and given distinct seqnos and keys), decoded batch-wise by replay/store/dcp_batch.py in
1 MiB receive buffers, and written by replay/store/writer.py. Reported:

  baseline   pyarrow.parquet.write_table of the same rows in one call, zstd (no IPC
             copy, no rotation, no fsync): the floor for encoding these rows;
  writer     CaptureWriter.write of the pre-decoded batches + close (in-progress IPC,
             row groups, rotation at the default 256 MiB, rename);
  background the same through BackgroundWriter (what `capture` runs);
  pipeline   decode + BackgroundWriter, as `capture` minus the socket;
  peak RSS   a separate process streaming --rss-rows rows (decode -> background writer,
             nothing kept), VmHWM from /proc.
Ratios are against the baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.protocol.dcp.wire.messages import Mutation, encode
from dcptool.replay.store.background import BackgroundWriter
from dcptool.replay.store.dcp_batch import frames_to_record_batch
from dcptool.replay.store.writer import CaptureWriter

CHUNK = 8192   # frames per receive buffer (~1 MiB)


def template() -> tuple[bytes, int, int]:
    """One ~128-byte mutation; offsets of its by_seqno and of the key digits."""
    key = b"key-0000000000"
    m = Mutation(vbucket=7, key=key, value=b'{"v":"' + b"x" * 50 + b'"}', by_seqno=1, rev_seqno=1,
                 item_flags=0, expiration=0, lock_time=0, opaque=0xDEADBEEF, cas=123456789,
                 datatype=1)
    frame = encode(m)
    ext_len = frame[4]
    key_at = 24 + ext_len + (len(key) - 10)
    return frame, 24, key_at   # mutation extras begin with by_seqno (8 bytes, big endian)


def make_buffers(rows: int):
    frame, seq_at, key_at = template()
    size = len(frame)
    out = []
    for start in range(0, rows, CHUNK):
        n = min(CHUNK, rows - start)
        buf = np.tile(np.frombuffer(frame, np.uint8), n).reshape(n, size)
        seq = np.arange(start + 1, start + n + 1, dtype=">u8")
        buf[:, seq_at:seq_at + 8] = seq.view(np.uint8).reshape(n, 8)
        digits = np.char.zfill(np.arange(start, start + n).astype(str), 10).astype("S10")
        buf[:, key_at:key_at + 10] = np.frombuffer(digits.tobytes(), np.uint8).reshape(n, 10)
        out.append(buf.tobytes())
    return out, size


def decode(buffers):
    batches, frame_no = [], 0
    for buf in buffers:
        rb, consumed, err = frames_to_record_batch(buf, frame_no_start=frame_no, ts_ns=time.time_ns(),
                                                   mono_ns=time.monotonic_ns(), direction=0)
        assert consumed == len(buf) and err is None and rb.num_rows
        frame_no += rb.num_rows
        batches.append(rb)
    return batches


def timed(fn):
    t = time.perf_counter()
    result = fn()
    return time.perf_counter() - t, result


def rss_child(rows: int, directory: str) -> dict:
    frame_buffers, _ = make_buffers(CHUNK * 4)      # reused: the capture runs "forever"
    w = CaptureWriter(directory, "dcp", source="bench://", options={})
    bg = BackgroundWriter(w)
    frame_no = 0
    t = time.perf_counter()
    while frame_no < rows:
        for buf in frame_buffers:
            rb, _, _ = frames_to_record_batch(buf, frame_no_start=frame_no, ts_ns=time.time_ns(),
                                              mono_ns=time.monotonic_ns())
            frame_no += rb.num_rows
            bg.submit(rb, block=True)
    segs = bg.close()
    dt = time.perf_counter() - t
    return {"rows": frame_no, "seconds": dt, "segments": len(segs), "peak_rss_mib": peak_rss_mib()}


def peak_rss_mib() -> float:
    """VmHWM of this process. (getrusage's ru_maxrss would carry over the parent's peak
    through fork + exec on Linux.)"""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--rss-rows", type=int, default=5_000_000)
    ap.add_argument("--rss-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_rows, args.rss_child)))
        return

    tmp = tempfile.mkdtemp(prefix="dcptool-bench-")
    try:
        buffers, size = make_buffers(args.rows)
        wire = sum(map(len, buffers))
        t_dec, batches = timed(lambda: decode(buffers))
        table = pa.Table.from_batches(batches)
        print(f"{args.rows:,} mutations of {size} bytes ({wire / 1e6:.1f} MB on the wire), "
              f"{table.nbytes / 1e6:.1f} MB as Arrow; decode {args.rows / t_dec:,.0f} frames/s")

        def baseline():
            pq.write_table(table, os.path.join(tmp, "baseline.parquet"), compression="zstd")

        def writer(sub):
            d = os.path.join(tmp, sub)
            w = CaptureWriter(d, "dcp", source="bench://", options={})
            for b in batches:
                w.write(b)
            return w.close()

        def background(sub, src):
            d = os.path.join(tmp, sub)
            w = CaptureWriter(d, "dcp", source="bench://", options={})
            bg = BackgroundWriter(w)
            if src is None:
                for b in batches:
                    bg.submit(b, block=True)
            else:
                frame_no = 0
                for buf in src:
                    rb, _, _ = frames_to_record_batch(buf, frame_no_start=frame_no,
                                                      ts_ns=time.time_ns(), mono_ns=time.monotonic_ns())
                    frame_no += rb.num_rows
                    bg.submit(rb, block=True)
            return bg.close()

        t_base, _ = timed(baseline)
        base_size = os.path.getsize(os.path.join(tmp, "baseline.parquet"))
        results = [("baseline", t_base, base_size)]
        for name, fn in (("writer", lambda: writer("w")),
                         ("background", lambda: background("bg", None)),
                         ("pipeline", lambda: background("pipe", buffers))):
            dt, segs = timed(fn)
            assert sum(s["rows"] for s in segs) == args.rows
            results.append((name, dt, sum(s["bytes"] for s in segs)))
        print(f"{'':12}{'rows/s':>12}{'wire MB/s':>11}{'on disk':>10}{'B/row':>7}{'time/baseline':>15}")
        for name, dt, nbytes in results:
            print(f"{name:12}{args.rows / dt:>12,.0f}{wire / dt / 1e6:>11.1f}{nbytes / 1e6:>8.1f}MB"
                  f"{nbytes / args.rows:>7.1f}{dt / t_base:>15.2f}")
        batches = table = None  # freed before the RSS child runs (the closures above are done with them)
        child = subprocess.run([sys.executable, __file__, "--rss-rows", str(args.rss_rows),
                                "--rss-child", os.path.join(tmp, "rss")],
                               capture_output=True, text=True, check=True)
        r = json.loads(child.stdout)
        print(f"peak RSS streaming {r['rows']:,} rows into {r['segments']} segment(s): "
              f"{r['peak_rss_mib']:.0f} MiB ({r['rows'] / r['seconds']:,.0f} rows/s end to end)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
