"""Benchmark: a capture of many small segments against one file of the same rows (issue 24.15:
`inspect`, `verify`, `replay` open a capture of 5,000 segments in <= 2x the time of one file
of the same rows).

    .venv/bin/python tests/bench/bench_segments.py            # 5,000 one-row segments
    .venv/bin/python tests/bench/bench_segments.py 20000      # segments to write

Both captures hold the same protocol-clean DCP rows (one stream request and its answer, a
snapshot marker, then mutations with increasing seqnos), written with the capture writer's
Parquet settings; one is a single segment, the other one segment per row. Each command runs
in a child process, both captures in the same run, and the ratio is printed per command;
then `dcptool compact` of the many-segment capture is timed, and the three commands again
on what it left, against the same one-file times.

Measured 2026-11-26 on the shared 2-core dev machine (5,000 rows; wall s / CPU s):
  before issue 24.15: inspect 39.1 / 26.5, verify 40.0 / 20.5, replay 69.0 / 46.1 (one file 0.8-1.2)
  session 8:          inspect 15.0 / 11.2, verify 12.2 /  9.1, replay 18.3 / 17.6 (one file 0.8-1.8)
  session 9, before:  inspect  8.6 / 10.9, verify  8.3 / 11.5, replay 15.3 / 18.1 (one file 0.5-0.6, load 1.2)
  session 9, after:   inspect  7.7 /  5.6, verify  9.3 /  6.1, replay 13.0 /  7.9 (one file 0.8-1.2 /
                      0.4-0.6, load 7-12: read the CPU)
Each file is now parsed once and read once per command (tests/hostile/test_adversary_store.py
counts it). The goal (<= 2x one file) is not reached: what is left is per file, in pyarrow:
parsing its footer (~0.27 ms for the DCP schema's ~9 KB footer) and opening and reading it
(~0.25 ms, plus ~0.02 ms a column); 2x would be ~0.1 ms a file."""

from __future__ import annotations

import datetime as _dt
import os
import sys
import tempfile
import uuid

import pyarrow as pa

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from dcptool.replay.store import schema as S  # noqa: E402
from dcptool.replay.store.naming import segment_name  # noqa: E402
from dcptool.replay.store.segment import parquet_writer  # noqa: E402

COMMANDS = (["inspect", "--json"], ["verify", "--format", "jsonl"], ["replay", "--format", "jsonl"])


def rows(n: int) -> pa.Table:
    """n protocol-clean DCP rows (n >= 4): stream request, its answer, a marker, mutations."""
    schema = S.capture_schema("dcp")
    items = n - 3
    cols: dict[str, list] = {name: [None] * n for name in schema.names}
    cols["frame_no"] = list(range(n))
    cols["conn"] = [0] * n
    cols["ts"] = [1_700_000_000_000_000_000 + i * 1000 for i in range(n)]
    cols["mono_ns"] = [i * 1000 for i in range(n)]
    cols["direction"] = ["out"] + ["in"] * (n - 1)
    cols["op"] = ["stream_req", "stream_req", "snapshot_marker"] + ["mutation"] * items
    cols["opcode"] = [0x53, 0x53, 0x56] + [0x57] * items
    cols["magic"] = [0x80, 0x81, 0x80] + [0x80] * items
    cols["vbucket"] = [0] * n
    cols["opaque"] = [1] * n
    cols["status"] = [None, 0] + [None] * (n - 2)
    cols["req_start_seqno"] = [0] + [None] * (n - 1)
    cols["req_end_seqno"] = [2**64 - 1] + [None] * (n - 1)
    cols["req_vbucket_uuid"] = [0] + [None] * (n - 1)
    cols["req_snap_start"] = [0] + [None] * (n - 1)
    cols["req_snap_end"] = [0] + [None] * (n - 1)
    cols["req_flags"] = [0] + [None] * (n - 1)
    cols["failover_log"] = [None, [{"vbucket_uuid": 7, "seqno": 0}]] + [None] * (n - 2)
    cols["snap_start"] = [None, None, 1] + [None] * items
    cols["snap_end"] = [None, None, items] + [None] * items
    cols["snap_flags"] = [None, None, 1] + [None] * items
    cols["by_seqno"] = [None, None, None] + list(range(1, items + 1))
    cols["rev_seqno"] = [None, None, None] + [1] * items
    cols["key"] = [None, None, None] + [b"doc-%08d" % i for i in range(items)]
    cols["value_len"] = [None, None, None] + [16] * items
    cols["cas"] = [None, None, None] + [1000 + i for i in range(items)]
    cols["datatype"] = [None, None, None] + [1] * items
    cols["collection_id"] = [None, None, None] + [0] * items
    cols["item_flags"] = [None, None, None] + [0] * items
    cols["expiration"] = [None, None, None] + [0] * items
    cols["lock_time"] = [None, None, None] + [0] * items
    cols["raw"] = [b"\x80" + bytes(23) for _ in range(n)]
    arrays = []
    for field in schema:
        if field.name == "capture_id":
            arrays.append(pa.nulls(n, field.type))
        elif pa.types.is_dictionary(field.type):
            arrays.append(pa.array(cols[field.name], pa.string()).dictionary_encode().cast(field.type))
        elif field.name == "ts":
            arrays.append(pa.array(cols["ts"], pa.int64()).cast(field.type))
        else:
            arrays.append(pa.array(cols[field.name], field.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def write_capture(directory: str, table: pa.Table, rows_per_segment: int) -> list[str]:
    """`table` as one capture in `directory`, `rows_per_segment` rows a segment, named and
    labelled as the capture writer does (no fsync: this is test data)."""
    os.makedirs(directory, exist_ok=True)
    cid = str(uuid.UUID(int=0x5E6))
    started = _dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=_dt.timezone.utc)
    cid_col = pa.DictionaryArray.from_arrays(pa.array([0] * table.num_rows, pa.int32()), pa.array([cid]))
    table = table.set_column(0, table.schema.field(0), cid_col)
    paths = []
    for seg, start in enumerate(range(0, table.num_rows, rows_per_segment)):
        meta = {S.META_FORMAT: S.FORMAT_VERSION, S.META_PROTOCOL: "dcp", S.META_CAPTURE_ID: cid,
                S.META_SEGMENT: str(seg), S.META_STARTED_AT: started.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
                S.META_VERSION: "bench", S.META_SOURCE: "couchbase://127.0.0.1:11210/default",
                S.META_OPTIONS: "{}"}
        part = table.slice(start, rows_per_segment).replace_schema_metadata(meta)
        path = os.path.join(directory, segment_name("dcp", started, cid, seg))
        w = parquet_writer(path, part.schema, "zstd")
        w.write_table(part)
        w.close()
        paths.append(path)
    return paths


def timed(args: list[str]) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds user + system, exit code) of `dcptool ARGS` in a child
    process; CPU time is the steadier number on a shared machine."""
    import subprocess
    import time
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "dcptool.cli", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    return time.perf_counter() - t0, usage.ru_utime + usage.ru_stime, os.waitstatus_to_exitcode(status)


def main(argv: list[str]) -> None:
    n = int(argv[0]) if argv else 5000
    work = tempfile.mkdtemp(prefix="bench-segments-")
    t = rows(n)
    one, many = os.path.join(work, "one"), os.path.join(work, "many")
    write_capture(one, t, n)
    write_capture(many, t, 1)
    print(f"{n:,} rows: one file vs {n:,} one-row segments ({work})")
    base = {}
    for cmd in COMMANDS:
        (w1, c1, e1), (w2, c2, e2) = (timed([cmd[0], where, *cmd[1:]]) for where in (one, many))
        base[cmd[0]] = (w1, c1)
        print(f"  {cmd[0]:8s} one file {w1:6.2f} s ({c1:5.2f} s CPU, exit {e1})   "
              f"{n:,} segments {w2:6.2f} s ({c2:5.2f} s CPU, exit {e2})   "
              f"ratio {w2 / w1:.2f}x wall, {c2 / c1:.2f}x CPU")
    w, c, e = timed(["compact", many])
    print(f"  compact  {n:,} segments {w:6.2f} s ({c:5.2f} s CPU, exit {e}) -> {len(os.listdir(many))} file(s)")
    for cmd in COMMANDS:
        w1, c1 = base[cmd[0]]
        w2, c2, e2 = timed([cmd[0], many, *cmd[1:]])
        print(f"  {cmd[0]:8s} after compact {w2:6.2f} s ({c2:5.2f} s CPU, exit {e2})   "
              f"ratio {w2 / w1:.2f}x wall, {c2 / c1:.2f}x CPU (one file as above)")


if __name__ == "__main__":
    main(sys.argv[1:])
