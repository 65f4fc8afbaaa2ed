"""Benchmark: `dcptool import` of a large pcap, in MB/s of packet file, beside `tshark -r
FILE -T fields -e frame.number` reading the same file (printed as a ratio), and the
import's peak RSS.

The pcap is made by capturing `dcptool serve dcp` (real DCP frames, ITEMS x VALUE bytes)
and exporting that capture with `dcptool export` (16 KiB segments); BENCH_COPIES exports
it that many times into one file, as further connections, to reach a larger file.

    .venv/bin/python tests/bench/bench_import.py                  # 200k x 1 KiB: ~230 MB of pcap
    BENCH_SCALE=0.1 .venv/bin/python tests/bench/bench_import.py
    BENCH_VALUE=61 .venv/bin/python tests/bench/bench_import.py   # small mutations

Targets (issue 28): >= 5x tshark's rate, peak RSS <= 500 MiB (the file is streamed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

BIN = os.path.join(os.path.dirname(sys.executable), "dcptool")
SCALE = float(os.environ.get("BENCH_SCALE", "1"))
VALUE = int(os.environ.get("BENCH_VALUE", str(1024 - 67)))
ITEMS = int(200_000 * SCALE)


def timed(cmd, **kw) -> tuple[float, int, subprocess.CompletedProcess | None]:
    """(seconds, peak RSS bytes, None) of a command run to its end with output discarded."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.perf_counter() - t0
    err = proc.stderr.read().decode()
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {err[-2000:]}")
    return secs, usage.ru_maxrss * 1024, None


def make_pcap(d: str) -> str:
    srv = subprocess.Popen([BIN, "serve", "dcp", "--port", "0", "--items", str(ITEMS), "--vbuckets", "64",
                            "--value-size", str(VALUE)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        addr = json.loads(srv.stdout.readline())["listening"]
        subprocess.run([BIN, "capture", f"couchbase://{addr}/default", "-o", f"{d}/cap", "--quiet"],
                       check=True, timeout=3600)
    finally:
        srv.terminate()
        srv.wait(30)
    path = f"{d}/big.pcap"
    subprocess.run([BIN, "export", f"{d}/cap", "-o", path, "--port", "11210"], check=True, timeout=3600,
                   stderr=subprocess.DEVNULL)
    return path


def main() -> None:
    tshark = shutil.which("tshark")
    with tempfile.TemporaryDirectory(prefix="bench-import-") as d:
        t0 = time.perf_counter()
        path = make_pcap(d)
        size = os.path.getsize(path)
        print(f"pcap: {size / 1e6:,.1f} MB ({ITEMS:,} items of {VALUE} B), made in {time.perf_counter() - t0:.1f} s")
        for codec in ("lz4", "zstd"):
            secs, rss, _ = timed([BIN, "import", path, "-o", f"{d}/imp-{codec}", "--compression", codec])
            rate = size / 1e6 / secs
            print(f"dcptool import --compression {codec}: {secs:.2f} s, {rate:,.1f} MB/s, "
                  f"peak RSS {rss / 2**20:,.0f} MiB")
        if tshark:
            tsecs, trss, _ = timed([tshark, "-r", path, "-T", "fields", "-e", "frame.number"])
            trate = size / 1e6 / tsecs
            print(f"tshark -r -T fields -e frame.number: {tsecs:.2f} s, {trate:,.1f} MB/s, peak RSS {trss / 2**20:,.0f} MiB")
            print(f"ratio import (zstd) / tshark: {rate / trate:.2f}x (goal >= 5x)")
        else:
            print("tshark not installed: no baseline")
        print(f"peak RSS goal <= 500 MiB: {'met' if rss <= 500 * 2**20 else 'NOT met'}")


if __name__ == "__main__":
    main()
