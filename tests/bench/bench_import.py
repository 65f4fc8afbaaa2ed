"""Benchmark: `dcptool import` of a 1 GB pcap, in MB/s of packet file, beside `tshark -r FILE`
(a full dissection: every packet through Ethernet/IP/TCP and Wireshark's couchbase
dissector for its summary line) reading the same file, printed as a ratio, and the
import's peak RSS.

The pcap is made once by capturing `dcptool serve dcp` (real DCP frames, ITEMS x VALUE
bytes) and exporting that capture with `dcptool export` (16 KiB segments, BENCH_MSS); it is kept at
BENCH_PCAP (default /tmp/dcptool-bench-import-<items>x<value>.pcap) and reused by later
runs, since making it takes longer than importing it.

    .venv/bin/python tests/bench/bench_import.py                  # 1M x 1 KiB: ~1.03 GB of pcap
    BENCH_SCALE=0.1 .venv/bin/python tests/bench/bench_import.py  # 100k items: ~100 MB
    BENCH_VALUE=61 .venv/bin/python tests/bench/bench_import.py   # small mutations
    BENCH_MSS=1448 .venv/bin/python tests/bench/bench_import.py   # Ethernet-sized segments

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
ITEMS = int(1_000_000 * SCALE)
MSS = int(os.environ.get("BENCH_MSS", "16384"))      # 1448: the segments of an Ethernet capture
PCAP = os.environ.get("BENCH_PCAP", f"/tmp/dcptool-bench-import-{ITEMS}x{VALUE}"
                      + ("" if MSS == 16384 else f"-mss{MSS}") + ".pcap")


def timed(cmd, **kw) -> tuple[float, int]:
    """(seconds, peak RSS bytes) of a command run to its end with its output discarded."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)
    err = proc.stderr.read().decode()     # read before waiting: a full pipe would block it
    _, status, usage = os.wait4(proc.pid, 0)
    secs = time.perf_counter() - t0
    proc.stderr.close()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[0]} failed ({proc.returncode}): {err[-2000:]}")
    return secs, usage.ru_maxrss * 1024


def make_pcap(path: str) -> None:
    part = path + ".part.pcap"     # export writes pcap or pcapng by the name's suffix; tcpdump's is pcap
    with tempfile.TemporaryDirectory(prefix="bench-import-") as d:
        srv = subprocess.Popen([BIN, "serve", "dcp", "--port", "0", "--items", str(ITEMS), "--vbuckets", "64",
                                "--value-size", str(VALUE)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True)
        try:
            addr = json.loads(srv.stdout.readline())["listening"]
            subprocess.run([BIN, "capture", f"couchbase://{addr}/default", "-o", f"{d}/cap", "--quiet"],
                           check=True, timeout=3600)
        finally:
            srv.terminate()
            srv.wait(30)
        subprocess.run([BIN, "export", f"{d}/cap", "-o", part, "--port", "11210",
                        "--mss", str(MSS)], check=True,
                       timeout=3600, stderr=subprocess.DEVNULL)
        os.replace(part, path)


def main() -> None:
    tshark = shutil.which("tshark")
    if not os.path.exists(PCAP):
        t0 = time.perf_counter()
        make_pcap(PCAP)
        print(f"made {PCAP} in {time.perf_counter() - t0:.1f} s")
    size = os.path.getsize(PCAP)
    print(f"pcap: {size / 1e6:,.1f} MB ({ITEMS:,} items of {VALUE} B)")
    with tempfile.TemporaryDirectory(prefix="bench-import-") as d:
        rates = {}
        for codec in ("lz4", "zstd"):
            secs, rss = timed([BIN, "import", PCAP, "-o", f"{d}/imp-{codec}", "--compression", codec])
            rates[codec] = size / 1e6 / secs
            print(f"dcptool import --compression {codec}: {secs:.2f} s, {rates[codec]:,.1f} MB/s, "
                  f"peak RSS {rss / 2**20:,.0f} MiB")
            shutil.rmtree(f"{d}/imp-{codec}")
        if tshark:
            tsecs, trss = timed([tshark, "-r", PCAP])
            trate = size / 1e6 / tsecs
            print(f"tshark -r: {tsecs:.2f} s, {trate:,.1f} MB/s, peak RSS {trss / 2**20:,.0f} MiB")
            for codec, rate in rates.items():
                print(f"ratio import ({codec}) / tshark -r: {rate / trate:.2f}x (goal >= 5x)")
        else:
            print("tshark not installed: no baseline")
        print(f"peak RSS goal <= 500 MiB: {'met' if rss <= 500 * 2**20 else 'NOT met'}")


if __name__ == "__main__":
    main()
