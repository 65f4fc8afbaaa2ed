"""Benchmark of `dcptool trace` on a large generated DCP capture: the trace of one key with
the key index (replay/store/key_index.py) against the same capture without it and against a
full scan with pyarrow, in the same run, printed as ratios.

    .venv/bin/python tests/bench/bench_trace.py              # 2M frames
    .venv/bin/python tests/bench/bench_trace.py 10000000     # sizes to run (BENCHMARKS.md: 10M)

The capture is the vectorised generator of bench_replay.py (mutations, deletions,
expirations over 1024 vbuckets of 1/10 as many documents as frames, snapshot markers,
stream-request answers), written twice: as bench_replay writes it (row groups of 1M rows,
no key index: an old capture), and copied through the capture writer's own Parquet segment
(replay/store/segment.ParquetSegment: its row groups of ~16 MiB of Arrow rows, finished
with the key index). Timed, each the best of 3 (wall, and the process's CPU seconds: the
machine is shared):
  - trace:      replay/check/trace.trace(DIR, [KEY]) in this process, on the indexed capture
  - cli:        `dcptool trace DIR KEY --format jsonl` as a subprocess (start-up included), once
  - old:        the same trace on the capture without the index (row groups read whole)
  - full scan:  pyarrow.parquet.read_table of the columns trace reads for a key
                (trace_read.KEY_COLUMNS) for every row, filtered on the key
and checks that trace found every change of the key the full scan found, with the same story
on both captures, and prints the row groups read.
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
from dcptool.replay.check import trace_read as R  # noqa: E402
from dcptool.replay.store import segment  # noqa: E402

DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
NAME = "dcp-20251122T000000.000000Z-b0000000-000000.parquet"


def best(fn, runs: int = 3):
    out, times, cpus = None, [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        times.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return min(times), min(cpus), out


def through_capture_writer(src: str, dst: str) -> None:
    """`src` copied through the capture writer's Parquet segment (its row groups, its key index)."""
    pf = pq.ParquetFile(src)
    seg = segment.ParquetSegment(dst, pf.schema_arrow, "zstd")
    for batch in pf.iter_batches(batch_size=65536):
        seg.add(batch)
    seg.finish()


def bench(frames: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        old, new = os.path.join(d, "old"), os.path.join(d, "new")
        os.makedirs(old)
        os.makedirs(new)
        t0 = time.perf_counter()
        generate(os.path.join(old, NAME), frames, docs=max(1000, frames // 10))
        through_capture_writer(os.path.join(old, NAME), os.path.join(new, NAME))
        gen = time.perf_counter() - t0
        sizes = [os.path.getsize(os.path.join(x, NAME)) for x in (old, new)]
        groups = [pq.read_metadata(os.path.join(x, NAME)).num_row_groups for x in (old, new)]
        key = b"doc-42"

        R.STATS.update(dict.fromkeys(R.STATS, 0))
        t_trace, c_trace, rows = best(lambda: T.trace([new], [key]))
        read = R.STATS["row_groups_read"] // 3
        t_old, c_old, rows_old = best(lambda: T.trace([old], [key]))
        assert rows == rows_old
        changes = sum(r["event"] == "change" for r in rows)

        def full_scan():
            t = pq.read_table(os.path.join(new, NAME), columns=R.KEY_COLUMNS)
            return t.filter(pc.equal(t.column("key"), key)).num_rows

        t_scan, c_scan, scanned = best(full_scan)
        t0 = time.perf_counter()
        res = subprocess.run([DCPTOOL, "trace", new, key.decode(), "--format", "jsonl"], capture_output=True, text=True)
        t_cli = time.perf_counter() - t0
        assert res.returncode == 0, res.stderr
        assert changes == scanned, (changes, scanned)
        print(f"{frames:>11,} frames (generated and copied in {gen:.0f} s): key {key.decode()} {changes} change(s), "
              f"verdict {rows[-1]['verdict']}")
        print(f"    old capture {sizes[0] / 2**20:.0f} MiB, {groups[0]} row groups; with the key index "
              f"{sizes[1] / 2**20:.0f} MiB, {groups[1]} row groups, {read} row-group reads past the probe columns per trace (key rows and stream rows)")
        print(f"    trace {t_trace:.3f} s ({c_trace:.2f} s CPU)   cli {t_cli:.3f} s   without index {t_old:.3f} s "
              f"({c_old:.2f} s CPU)   full scan {t_scan:.3f} s ({c_scan:.2f} s CPU)")
        print(f"    trace / full scan = {t_trace / t_scan:.2f}   trace / without index = {t_trace / t_old:.2f}")


def main(argv: list[str]) -> None:
    for n in [int(a) for a in argv] or [2_000_000]:
        bench(n)


if __name__ == "__main__":
    main(sys.argv[1:])
