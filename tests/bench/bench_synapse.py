"""Benchmark: lines/s that `dcptool capture synapse://` records from `dcptool serve synapse`,
beside a bare line-draining client (socket reads + newline count, nothing else) against
the same server in the same run. Target: >= 300,000 lines/s of ~150-byte RDATA lines.

    .venv/bin/python tests/bench/bench_synapse.py [--lines 2000000]

Each measurement gets its own server (same seed, so the same lines). The capture figure is
the whole command's wall time (start-up, connect, handshake, write, close) over the lines
it recorded; `in-loop` excludes start-up by timing from the first to the last line written.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.support.paths import ROOT  # noqa: E402

PY = sys.executable


def start_server(lines: int, seed: int):
    proc = subprocess.Popen([PY, "-m", "dcptool.cli", "serve", "synapse", "--port", "0",
                             "--items", str(lines), "--seed", str(seed)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    addr = json.loads(proc.stdout.readline())["listening"]
    host, port = addr.rsplit(":", 1)
    return proc, host, int(port)


def stop(proc):
    proc.terminate()
    proc.wait(10)


def bare_drain(host: str, port: int, want: int) -> tuple[float, int]:
    """Read until `want` lines arrived; count newlines only."""
    with socket.create_connection((host, port)) as s:
        s.sendall(b"NAME bare\nPING 0\nREPLICATE\n")
        got = 0
        nbytes = 0
        t0 = time.perf_counter()
        while got < want:
            data = s.recv(1 << 18)
            if not data:
                break
            got += data.count(b"\n")
            nbytes += len(data)
        return time.perf_counter() - t0, nbytes


def capture(host: str, port: int, want: int, outdir: str) -> tuple[float, dict]:
    t0 = time.perf_counter()
    res = subprocess.run([PY, "-m", "dcptool.cli", "capture", f"synapse://{host}:{port}",
                          "-o", outdir, "--quiet", "--json", "--max-messages", str(want)],
                         cwd=ROOT, capture_output=True, timeout=600)
    dt = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"capture failed ({res.returncode}): {res.stderr.decode()[-2000:]}")
    return dt, json.loads(res.stdout)


def in_loop_seconds(outdir: str) -> float:
    from dcptool.replay.store.reader import find_captures, read_capture_table
    t = read_capture_table(find_captures([outdir]), columns=["mono_ns"]).column("mono_ns")
    import pyarrow.compute as pc
    mm = pc.min_max(t).as_py()
    return (mm["max"] - mm["min"]) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    n = args.lines
    greeting = 2 + 18
    want = n + greeting

    proc, host, port = start_server(n, args.seed)
    try:
        bare_s, nbytes = bare_drain(host, port, want)
    finally:
        stop(proc)
    avg = nbytes / want

    proc, host, port = start_server(n, args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            cap_s, summary = capture(host, port, want, tmp)
        finally:
            stop(proc)
        loop_s = in_loop_seconds(tmp)
        size = sum(f["bytes"] for f in summary["files"])
        rows = sum(f["rows"] for f in summary["files"])

    bare_rate = want / bare_s
    cap_rate = want / cap_s
    loop_rate = want / loop_s if loop_s > 0 else float("inf")
    print(f"lines: {want:,} (avg {avg:.0f} bytes/line), server: dcptool serve synapse")
    print(f"bare drain client : {bare_rate:12,.0f} lines/s  ({bare_s:.2f} s)")
    print(f"dcptool capture   : {cap_rate:12,.0f} lines/s  ({cap_s:.2f} s wall, incl. start-up)")
    print(f"  in-loop         : {loop_rate:12,.0f} lines/s  ({loop_s:.2f} s first->last line)")
    print(f"  capture/bare    : {cap_rate / bare_rate:.2f}x   (in-loop/bare {loop_rate / bare_rate:.2f}x)")
    print(f"  rows {rows:,}, parquet {size / 1e6:.1f} MB ({size / rows:.1f} bytes/row)")
    print(f"target 300,000 lines/s: {'met' if cap_rate >= 300_000 else 'NOT met'}")


if __name__ == "__main__":
    os.chdir(ROOT)
    main()
