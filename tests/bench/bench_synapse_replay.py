"""Benchmark: memory and time of Synapse `replay` and `inspect` as the capture grows
(issue 14 item 8). Builds seeded Synapse captures of 1M and 10M lines with the capture's
own batch builder (replay/store/synapse_batch.py, as `capture` writes them), then runs

    dcptool replay CAP --table positions --checksum
    dcptool inspect CAP --json

as subprocesses and prints the wall time and peak RSS of each, and the 10M/1M ratio of
the peaks. Goal: the 10M peak within 1.5x of the 1M peak. Nothing is asserted.

    .venv/bin/python tests/bench/bench_synapse_replay.py [--sizes 1000000,10000000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.support.paths import ROOT  # noqa: E402

PY = sys.executable
BLOCK = 1 << 17   # lines per receive block (and per Parquet row group)
STREAMS = [(b"events", b"master"), (b"caches", b"master"), (b"typing", b"worker1"),
           (b"receipts", b"master"), (b"presence", b"worker2")]


def _block(rng: random.Random, tokens: dict, n: int) -> bytes:
    """n received lines: RDATA rows (some `batch`), a POSITION now and then (with a gap
    once in a while), in the shape Synapse sends them."""
    out = []
    for _ in range(n):
        k = rng.randrange(len(STREAMS))
        stream, inst = STREAMS[k]
        r = rng.random()
        if r < 0.002:
            prev = tokens[k] + (rng.randrange(2, 50) if rng.random() < 0.1 else 0)
            tokens[k] = prev + rng.randrange(1, 5)
            out.append(b"POSITION %s %s %d %d" % (stream, inst, prev, tokens[k]))
        elif r < 0.2:
            out.append(b'RDATA %s %s batch ["$e%d","!room:example.org","m.room.message",null]'
                       % (stream, inst, rng.getrandbits(40)))
        else:
            tokens[k] += 1
            out.append(b'RDATA %s %s %d ["$e%d","!room:example.org","m.room.message",null]'
                       % (stream, inst, tokens[k], rng.getrandbits(40)))
    return b"\n".join(out) + b"\n"


def build(directory: str, lines: int, seed: int = 7) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dcptool.protocol.synapse.bulk import Scan
    from dcptool.replay.store.schema import capture_schema
    from dcptool.replay.store.synapse_batch import build_batch_scan
    from tests.support.capgen import file_name

    rng = random.Random(seed)
    cid = str(uuid.UUID(int=rng.getrandbits(128), version=4))
    started = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    meta = {"dcptool.format": "1", "dcptool.protocol": "synapse", "dcptool.capture_id": cid,
            "dcptool.started_at": started.isoformat(timespec="microseconds").replace("+00:00", "Z"),
            "dcptool.version": "0.1.0", "dcptool.source": "synapse://127.0.0.1:9092",
            "dcptool.options": "{}", "dcptool.segment": "0"}
    schema = capture_schema("synapse", meta)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, file_name(meta, 0))
    tokens = {k: 1000 for k in range(len(STREAMS))}
    ts = int(started.timestamp() * 1e9)
    done = 0
    with pq.ParquetWriter(path, schema, compression="zstd") as w:
        while done < lines:
            n = min(BLOCK, lines - done)
            conn = 1 + done * 3 // lines          # two reconnects along the way
            b = build_batch_scan(Scan(_block(rng, tokens, n)), frame_no=done, conn=conn,
                                 ts_ns=ts + done * 1000, mono_ns=done * 1000)
            cols = {f.name: b.column(f.name) for f in b.schema}
            cols["capture_id"] = pa.DictionaryArray.from_arrays(
                pa.array([0] * n, pa.int32()), pa.array([cid]))
            t = pa.Table.from_arrays([cols[f.name] for f in schema], schema=schema)
            w.write_table(t, row_group_size=BLOCK)
            done += n
    return path


def measure(args: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS MiB, exit code) of `dcptool ARGS`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([PY, "-m", "dcptool.cli", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode(errors="replace").strip()
    proc.stderr.close()
    if proc.returncode:
        print(f"  exit {proc.returncode}: {err[-300:]}")
    return wall, usage.ru_maxrss / 1024, proc.returncode


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1000000,10000000")
    ap.add_argument("--keep", default=None, help="build the captures here and keep them")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    work = a.keep or tempfile.mkdtemp(prefix="bench-synapse-replay-")
    results = {}
    try:
        for n in sizes:
            d = os.path.join(work, f"syn-{n}")
            if not os.path.isdir(d) or not os.listdir(d):
                # built in a child process: this one stays small, because Linux counts a
                # child's RSS before exec (a copy of ours) in its peak
                t0 = time.perf_counter()
                subprocess.run([PY, __file__, "--build", d, str(n)], check=True, cwd=ROOT)
                size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
                print(f"built {n:,} lines in {time.perf_counter() - t0:.1f} s: "
                      f"{size / 2**20:.1f} MiB of Parquet", flush=True)
            for name, args in (("replay positions --checksum",
                                ["replay", d, "--table", "positions", "--checksum"]),
                               ("inspect --json", ["inspect", d, "--json"])):
                wall, peak, rc = measure(args)
                results[(name, n)] = peak
                print(f"{n:>11,} lines  {name:<28} {wall:7.2f} s  peak RSS {peak:8.1f} MiB"
                      + (f"  (exit {rc})" if rc else ""), flush=True)
        if len(sizes) >= 2:
            lo, hi = sizes[0], sizes[-1]
            for name in ("replay positions --checksum", "inspect --json"):
                ratio = results[(name, hi)] / results[(name, lo)]
                print(f"{name}: peak {hi:,} / {lo:,} = {ratio:.2f}x (goal <= 1.5x)")
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"]:
        build(sys.argv[2], int(sys.argv[3]))
    else:
        main(sys.argv[1:])
