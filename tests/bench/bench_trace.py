"""Benchmark of `dcptool trace` on a large generated DCP capture: the trace of one key against
a full scan of the same capture with pyarrow, in the same run, printed as a ratio.

    .venv/bin/python tests/bench/bench_trace.py              # 2M frames
    .venv/bin/python tests/bench/bench_trace.py 10000000     # sizes to run

The capture is the vectorised generator of bench_replay.py (mutations, deletions,
expirations over 1024 vbuckets, snapshot markers, stream-request answers; row groups of
1M rows). Timed, each the best of 3:
  - trace:      replay/check/trace.trace(DIR, [KEY]) in this process (what `dcptool trace` runs)
  - cli:        `dcptool trace DIR KEY --format jsonl` as a subprocess (start-up included), once
  - full scan:  pyarrow.parquet.read_table of the columns trace reads for a key
                (replay/check/trace.py KEY_COLUMNS) for every row, filtered on the key
and checks that trace found every change of the key the full scan found.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_replay import generate  # noqa: E402
from dcptool.replay.check import trace as T  # noqa: E402

DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")


def best(fn, runs: int = 3):
    out, times = None, []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def bench(frames: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "dcp-20251122T000000.000000Z-b0000000-000000.parquet")
        t0 = time.perf_counter()
        generate(path, frames, docs=max(1000, frames // 10))
        gen = time.perf_counter() - t0
        size = os.path.getsize(path)
        key = b"doc-42"

        t_trace, rows = best(lambda: T.trace([d], [key]))
        changes = sum(r["event"] == "change" for r in rows)

        def full_scan():
            t = pq.read_table(path, columns=T.KEY_COLUMNS)
            return t.filter(pc.equal(t.column("key"), key)).num_rows

        t_scan, scanned = best(full_scan)
        t0 = time.perf_counter()
        res = subprocess.run([DCPTOOL, "trace", d, key.decode(), "--format", "jsonl"], capture_output=True, text=True)
        t_cli = time.perf_counter() - t0
        assert res.returncode == 0, res.stderr
        assert changes == scanned, (changes, scanned)
        verdict = rows[-1]["verdict"]
        print(f"{frames:>11,} frames ({size / 2**20:.0f} MiB, generated in {gen:.1f} s): key {key.decode()} "
              f"{changes} change(s), verdict {verdict}")
        print(f"    trace {t_trace:.3f} s   cli {t_cli:.3f} s   full scan {t_scan:.3f} s   "
              f"trace / full scan = {t_trace / t_scan:.2f}")


def main(argv: list[str]) -> None:
    for n in [int(a) for a in argv] or [2_000_000]:
        bench(n)


if __name__ == "__main__":
    main(sys.argv[1:])
