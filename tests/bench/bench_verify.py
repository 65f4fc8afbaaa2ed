"""Benchmark of `dcptool verify` against plain `dcptool replay --table frames` on the same
generated DCP capture, in the same run (issue 16: checking should not cost more than
reading; goal >= 1x).

    .venv/bin/python tests/bench/bench_verify.py            # 1M frames
    .venv/bin/python tests/bench/bench_verify.py 10000000   # sizes to run

The capture is protocol-clean (verify must report nothing on it): 1024 vbuckets, one stream
request answered with a failover log each, then per vbucket a snapshot marker every 20 frames
whose range holds exactly the 19 items after it (mutations, deletions, expirations with
increasing seqnos), in random vbucket interleaving. It is written row group by row group, in
bounded memory, and kept between runs in the work directory."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store.schema import capture_schema  # noqa: E402
from tests.bench.bench_replay import timed_cli  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402

NVB = 1024
PERIOD = 20          # a marker, then 19 items, per vbucket


def _column(schema: pa.Schema, name: str, values, mask=None) -> pa.Array:
    f = schema.field(name)
    if pa.types.is_dictionary(f.type):
        return pa.array(values, pa.string(), mask=mask).dictionary_encode().cast(f.type)
    if f.name == "ts":
        return pa.array(values, pa.int64()).cast(f.type)
    return pa.array(values, mask=mask).cast(f.type)


def generate(path: str, frames: int, seed: int = 1, rows_per_group: int = 1 << 20) -> None:
    rng = np.random.default_rng(seed)
    cid = "c0000000-0000-4000-8000-%012d" % frames
    meta = {"dcptool.format": "1", "dcptool.protocol": "dcp", "dcptool.capture_id": cid,
            "dcptool.segment": "0", "dcptool.started_at": "2025-11-22T00:00:00.000000Z",
            "dcptool.version": "bench", "dcptool.source": "couchbase://127.0.0.1/bench",
            "dcptool.options": "{}"}
    schema = capture_schema("dcp", meta)

    def table(n, **cols):
        arrays = []
        for f in schema:
            if f.name in cols:
                v = cols[f.name]
                arrays.append(v if isinstance(v, pa.Array) else _column(schema, f.name, *(v if isinstance(v, tuple) else (v,))))
            elif f.name == "capture_id":
                arrays.append(_column(schema, "capture_id", [cid] * n))
            elif f.name == "conn":
                arrays.append(pa.array(np.ones(n, np.int32)))
            else:
                arrays.append(pa.nulls(n, f.type))
        return pa.Table.from_arrays(arrays, schema=schema)

    uuids = rng.integers(1, 2**63, NVB)
    with pq.ParquetWriter(path, schema, compression="zstd") as w:
        vb = np.arange(NVB)
        n = 2 * NVB
        direction = np.where(np.arange(n) % 2 == 0, "out", "in")
        vbs = np.repeat(vb, 2)
        w.write_table(table(
            n, frame_no=np.arange(n), ts=np.arange(n), direction=list(direction), op=["stream_req"] * n,
            vbucket=vbs, opaque=vbs, status=(np.zeros(n), direction == "out"),
            req_start_seqno=(np.zeros(n), direction == "in"), req_snap_start=(np.zeros(n), direction == "in"),
            req_snap_end=(np.zeros(n), direction == "in"),
            req_vbucket_uuid=(np.repeat(uuids, 2).astype(np.uint64), direction == "in"),
            failover_log=pa.array([None if d == "out" else [{"vbucket_uuid": int(uuids[v]), "seqno": 0}]
                                   for d, v in zip(direction, vbs)], schema.field("failover_log").type)))
        done = n
        count = np.zeros(NVB, np.int64)       # frames so far per vbucket
        while done < frames:
            n = min(rows_per_group, frames - done)
            v = rng.integers(0, NVB, n)
            order = np.argsort(v, kind="stable")
            per = np.bincount(v, minlength=NVB)
            within = np.empty(n, np.int64)
            within[order] = np.arange(n) - np.repeat(np.cumsum(per) - per, per)
            c = count[v] + within                  # this frame's number within its vbucket
            count += per
            marker = c % PERIOD == 0
            items_before = c - (c // PERIOD) - (~marker)   # items of the vbucket before this frame
            seqno = items_before + 1
            kind = rng.choice(3, n, p=[0.85, 0.1, 0.05])
            op = np.where(marker, "snapshot_marker", np.array(["mutation", "deletion", "expiration"])[kind])
            item = ~marker
            keys = np.char.add(b"doc-", rng.integers(0, 10**6, n).astype("S7"))
            w.write_table(table(
                n, frame_no=np.arange(done, done + n), ts=np.arange(done, done + n) * 1000,
                direction=["in"] * n, op=list(op), vbucket=v, magic=np.full(n, 0x80),
                by_seqno=(seqno, ~item), rev_seqno=(np.ones(n), ~item), key=pa.array(np.where(item, keys, None)),
                value_len=(rng.integers(10, 500, n), ~item), cas=(rng.integers(1, 2**62, n), ~item),
                snap_start=(seqno, item), snap_end=(seqno + PERIOD - 2, item),
                snap_flags=(np.ones(n), item), snap_version=(["2.0"] * n, item),
                raw=_headers(rng, n)))
            done += n


def _headers(rng, n: int) -> pa.Array:
    """n 24-byte frame headers with random bytes and a body length of 0 (bytes 8-11), as verify
    expects of raw (dcp.raw_short)."""
    hdr = rng.integers(0, 256, (n, 24), dtype=np.uint8)
    hdr[:, 0] = 0x80
    hdr[:, 8:12] = 0
    offsets = np.arange(0, 24 * (n + 1), 24, dtype=np.int32)
    return pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(offsets), pa.py_buffer(hdr.tobytes())])


def _run_out(args: list[str]) -> float:
    """Wall seconds of `dcptool ARGS > /dev/null` (stdout discarded, like a pipe reader)."""
    wall, _ = timed_cli(args)
    return wall


def run(frames: int, workdir: str) -> dict:
    cap = os.path.join(workdir, f"verify-cap-{frames}")
    os.makedirs(cap, exist_ok=True)
    src = os.path.join(cap, "dcp-20251122T000000.000000Z-c0000000-000000.parquet")
    if not os.path.exists(src):
        t0 = time.perf_counter()
        generate(src, frames)
        print(f"  generated {frames:,} frames in {time.perf_counter() - t0:.1f}s "
              f"({os.path.getsize(src) / 2**20:.0f} MiB)", flush=True)
    rows = pq.ParquetFile(src).metadata.num_rows
    # verify must be silent here, else the timing measures findings, not checking
    import subprocess
    res = subprocess.run([sys.executable, "-m", "dcptool.cli", "verify", cap, "--format", "jsonl"],
                         capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if res.returncode != 0:
        raise SystemExit(f"verify found something on the clean capture: {res.stdout[:500]} {res.stderr[-500:]}")
    verify_s = min(_run_out(["verify", cap, "--format", "jsonl"]) for _ in range(2))
    frames_s = _run_out(["replay", cap, "--table", "frames", "--format", "jsonl"])
    return {"frames": rows, "verify_s": verify_s, "replay_frames_s": frames_s}


def main(argv: list[str]) -> None:
    sizes = [int(a) for a in argv] or [1_000_000]
    workdir = os.environ.get("BENCH_DIR") or os.path.join(tempfile.gettempdir(), "dcptool-bench")
    os.makedirs(workdir, exist_ok=True)
    for frames in sizes:
        r = run(frames, workdir)
        v, f = r["frames"] / r["verify_s"], r["frames"] / r["replay_frames_s"]
        print(f"{r['frames']:,} frames: verify {r['verify_s']:.2f}s ({v:,.0f} frames/s), "
              f"replay --table frames {r['replay_frames_s']:.2f}s ({f:,.0f} frames/s); "
              f"verify / replay frames = {v / f:.2f}x (goal >= 1x)", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
