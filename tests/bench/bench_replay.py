"""Benchmark of `dcptool replay` on generated DCP captures of 1M and 10M frames.

For each size it times, in the same run and on the same Parquet:
  - `dcptool replay DIR --table documents --out OUT`            (in-process: DuckDB runs the plan of
                                                                 replay/rules/plans.py; a subprocess)
  - `dcptool replay DIR --master 'local[*]' --table documents --out OUT`
                                                                (embedded Spark, cold: JVM start included;
                                                                 the first such run of the benchmark, which
                                                                 writes the JVM's class archive, is timed apart)
  - `dcptool replay DIR --spark --table documents --out OUT`    (through a warm Spark Connect server
                                                                 of `dcptool spark start`; the server's
                                                                 start is timed once, apart)
  - the same `documents` as one plain DuckDB SQL query (the baseline; installed into the
    venv by this script when missing), written to Parquet too, timed twice: inside this
    warm process, and as a fresh `python -c` process like `dcptool replay` itself,
checks that the results are equal, and prints the ratios to DuckDB (goals: in-process <= 1.2x
the query by hand, Spark warm <= 4x, cold <= 8x), the cost per million frames, the 10M/1M time
ratio per engine (goal <= 12x), the in-process peak RSS next to DuckDB's (goal <= 1.2x), both
measured by tests/bench/replay_rss.py (each child's own peak).

The in-process goal is measured against the query *as a process*: a user running the query by
hand runs a process (interpreter start and `import duckdb` included), as `dcptool replay` is
one, and peak RSS is a measure of a process. The ratio to the query inside this warm process
is printed too, for reference, and the CPU seconds (user + system) of the in-process replay and
of the query's process, which a busy host disturbs less than wall time.

    .venv/bin/python tests/bench/bench_replay.py            # 1M and 10M
    .venv/bin/python tests/bench/bench_replay.py 1000000    # sizes to run
    BENCH_SCALE=100000 .venv/bin/python tests/bench/bench_replay.py bodies 1000000   # what bodies cost
The captures hold mutations, deletions, expirations over 1024 vbuckets, snapshot markers
and stream-request responses, and no rollbacks (so last-write-wins SQL is the right answer).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dcptool.replay.store.schema import capture_schema  # noqa: E402
from dcptool.replay.store.segment import dictionary_columns  # noqa: E402
from tests.support.paths import ROOT  # noqa: E402

OPS = np.array(["mutation", "deletion", "expiration", "snapshot_marker"])
# frame bytes as replay reads them: a body ends with the value (`value_len` bytes), REPLAY.md
# "Bodies"; the header's lengths are not read by replay
MUTATION_HEAD, DELETION_HEAD, MARKER = bytes(24 + 31), bytes(24 + 18), bytes(24 + 20)
VALUES = [json.dumps({"type": ["order", "user", "item"][i % 3], "n": i, "pad": "x" * (80 + i * 7 % 880)}).encode()
          for i in range(256)]
VALUE_LENS = np.array([len(v) for v in VALUES])


def generate(path: str, frames: int, docs: int, seed: int = 1, rows_per_group: int = 1 << 20) -> None:
    """A single-segment capture written row group by row group (bounded memory)."""
    rng = np.random.default_rng(seed)
    cid = "b0000000-0000-4000-8000-%012d" % frames
    meta = {"dcptool.format": "1", "dcptool.protocol": "dcp", "dcptool.capture_id": cid,
            "dcptool.segment": "0", "dcptool.started_at": "2025-11-22T00:00:00.000000Z",
            "dcptool.version": "bench", "dcptool.source": "couchbase://127.0.0.1/bench",
            "dcptool.options": "{}"}
    schema = capture_schema("dcp", meta)
    seqno = np.zeros(1024, np.int64)
    # the capture writer's own encodings (replay/store/segment.py), so Spark reads what it would
    with pq.ParquetWriter(path, schema, compression="zstd", use_dictionary=dictionary_columns(schema)) as w:
        # stream-request success responses, one per vbucket
        vb = np.arange(1024)
        fl = pa.array([[{"vbucket_uuid": int(u), "seqno": 0}] for u in rng.integers(1, 2**63, 1024)],
                      schema.field("failover_log").type)
        head = _table(schema, frame_no=np.arange(1024), vbucket=vb, op=np.full(1024, "stream_req"),
                      magic=np.full(1024, 0x81), status=np.zeros(1024), failover_log=fl)
        w.write_table(head)
        done = 1024
        while done < frames:
            n = min(rows_per_group, frames - done)
            kind = rng.choice(4, n, p=[0.80, 0.10, 0.05, 0.05])
            doc = rng.integers(0, docs, n)
            vb = (doc * 2654435761) % 1024  # a document always lives in the same vbucket
            key = np.char.add(b"doc-", doc.astype("S12"))
            # per-vbucket increasing seqnos, in frame order
            order = np.argsort(vb, kind="stable")
            counts = np.bincount(vb, minlength=1024)
            within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
            by = np.empty(n, np.int64)
            by[order] = seqno[vb[order]] + within + 1
            seqno += counts
            is_item = kind < 3
            # real frames: header, extras, key, and for a mutation a JSON value of 100-1,000 bytes
            pick = rng.integers(0, len(VALUES), n)
            vlen = VALUE_LENS[pick]
            raw = [(MUTATION_HEAD if k == 0 else DELETION_HEAD if k < 3 else MARKER)
                   + (key[i] + VALUES[pick[i]] if k == 0 else key[i] if k < 3 else b"")
                   for i, k in enumerate(kind.tolist())]
            ts = (1_763_800_000_000_000_000 + (done + np.arange(n)) * 1000).astype(np.int64)
            w.write_table(_table(
                schema, frame_no=np.arange(done, done + n), vbucket=vb, op=OPS[kind],
                magic=np.full(n, 0x80), ts=ts, key=np.where(is_item, key, None),
                by_seqno=np.where(is_item, by, None), rev_seqno=np.where(is_item, 1, None),
                cas=np.where(is_item, rng.integers(1, 2**63, n), None), datatype=np.where(is_item, 1, None),
                value_len=np.where(kind == 0, vlen, np.where(is_item, 0, None)),
                item_flags=np.where(kind == 0, 0, None), expiration=np.where(kind == 0, 0, None),
                snap_start=np.where(kind == 3, by, None), snap_end=np.where(kind == 3, by + 100, None),
                snap_flags=np.where(kind == 3, 1, None), snap_version=np.where(kind == 3, "2.0", None),
                raw=pa.array(raw, pa.binary())))
            done += n


def _table(schema: pa.Schema, **cols) -> pa.Table:
    n = len(next(iter(cols.values())))
    arrays = []
    for f in schema:
        v = cols.get(f.name)
        if f.name == "capture_id":
            arrays.append(pa.array([schema.metadata[b"dcptool.capture_id"].decode()] * n).dictionary_encode().cast(f.type))
        elif f.name == "direction":
            v = np.where(np.asarray(cols.get("magic")) == 0x81, "in", "in")
            arrays.append(pa.array(v).dictionary_encode().cast(f.type))
        elif f.name == "ts" and v is None:
            arrays.append(pa.array(np.arange(n, dtype=np.int64)).cast(f.type))
        elif v is None:
            arrays.append(pa.nulls(n, f.type))
        elif isinstance(v, pa.Array):
            arrays.append(v)
        elif f.name == "ts":
            arrays.append(pa.array(v).cast(f.type))
        elif pa.types.is_dictionary(f.type):
            arrays.append(pa.array(list(v) if v.dtype == object else v, pa.string()).dictionary_encode().cast(f.type))
        elif v.dtype == object:
            arrays.append(pa.array(list(v), f.type))
        else:
            arrays.append(pa.array(v).cast(f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def ensure_duckdb():
    try:
        import duckdb  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "duckdb"], check=True)
    import duckdb
    return duckdb


REPEAT = 2


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _with_cpu(fn) -> tuple[float, float]:
    """fn()'s result and the CPU seconds (user + system) of the children it waited for: on a
    busy host the CPU a process used says more than its wall time."""
    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime
    before = cpu()
    value = fn()
    return value, cpu() - before


def timed_cli(args: list[str], env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and ru_maxrss (MiB) of `dcptool ARGS` in a child process (not its peak:
    Linux starts a child's ru_maxrss from the parent's size at the fork; rss_columns has it)."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "dcptool.cli", *args], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    err = p.stderr.read().decode()
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"dcptool {' '.join(args)} failed: {err}")
    return wall, usage.ru_maxrss // 1024


DUCKDB_SQL = """
COPY (
  SELECT vbucket, collection_id, key,
         arg_max(by_seqno, frame_no) AS by_seqno, arg_max(rev_seqno, frame_no) AS rev_seqno,
         arg_max(cas, frame_no) AS cas,
         arg_max(CASE op WHEN 'mutation' THEN 'live' WHEN 'deletion' THEN 'deleted' ELSE 'expired' END, frame_no) AS state,
         arg_max(value_len, frame_no) AS value_len, max(frame_no) AS frame_no
  FROM read_parquet('{src}')
  WHERE direction = 'in' AND vbucket IS NOT NULL AND decode_error IS NULL
    AND op IN ('mutation', 'deletion', 'expiration')
  GROUP BY vbucket, collection_id, key
) TO '{dst}' (FORMAT parquet)
"""


def start_warm_server(workdir: str) -> tuple[dict, float]:
    """`dcptool spark start` on a picked port with its own state directory (so replays of this
    run find it); the environment for them, and the seconds the start took."""
    from tests.support.ports import PortTaken, pick_port, start_with_retry
    env = {"DCPTOOL_STATE_DIR": os.path.join(workdir, "state")}

    def start():
        # the JVM's port is given on the command line: picked, and picked again if taken meanwhile
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "dcptool.cli", "spark", "start", "--port", str(pick_port()),
                              "--idle-timeout", "1h"], env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if res.returncode != 0 and "is taken by another program" in res.stderr:
            raise PortTaken(res.stderr)
        if res.returncode != 0:
            raise SystemExit(f"spark start failed: {res.stderr.strip()}")
        return time.perf_counter() - t0
    return env, start_with_retry(start)


def stop_warm_server(env: dict) -> None:
    subprocess.run([sys.executable, "-m", "dcptool.cli", "spark", "stop"], env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
                   stderr=subprocess.DEVNULL, check=False)


def rss_columns(cap: str) -> dict:
    """Peak RSS (each child's own VmHWM, tests/bench/replay_rss.py) of the local engine and of
    DuckDB on the same capture, and the distinct documents."""
    from tests.bench import replay_rss
    m = replay_rss.measure(cap)
    return {"local_rss_mib": m["local_peak_mib"], "duckdb_rss_mib": m["duckdb_peak_mib"],
            "distinct_documents": m["distinct_documents"]}


def _archive_ready(env: dict) -> bool:
    import glob
    return bool(glob.glob(os.path.join(env["DCPTOOL_STATE_DIR"], "spark-cds-*.jsa")))


def _wait_archive(env: dict, limit: float = 300.0) -> None:
    """Until the JVM that writes the class archive has exited (it does so after the replay)."""
    import glob
    deadline = time.monotonic() + limit
    for pid_file in glob.glob(os.path.join(env["DCPTOOL_STATE_DIR"], "spark-cds-*.tmp.pid")):
        with open(pid_file) as f:
            pid = int(f.read().strip() or 0)
        while pid and os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
            time.sleep(0.5)   # a process we do not parent: poll, bounded


def run(frames: int, docs: int, workdir: str, spark: bool, warm_env: dict | None = None,
        cold_env: dict | None = None) -> dict:
    duckdb = ensure_duckdb()
    cap = os.path.join(workdir, f"cap-{frames}-{docs}")
    os.makedirs(cap, exist_ok=True)
    src = os.path.join(cap, "dcp-20251122T000000.000000Z-b0000000-000000.parquet")
    if not os.path.exists(src):
        t0 = time.perf_counter()
        generate(src, frames, docs)
        print(f"  generated {frames:,} frames / {docs:,} documents in {time.perf_counter() - t0:.1f}s "
              f"({os.path.getsize(src) / 2**20:.0f} MiB)", flush=True)
    out = {"frames": frames, "docs": docs}
    dd = os.path.join(workdir, f"duck-{frames}-{docs}.parquet")
    con = duckdb.connect()
    con.execute("SET threads TO 2")
    con.execute("SET enable_progress_bar = false")   # DuckDB's bar on the terminal past 2 s
    # each in-process measurement is the best of REPEAT runs (the first run of a process
    # after a big allocation elsewhere on this 2-core host can pay for the kernel's page work)
    out["duckdb_s"] = min(_timed(lambda: con.execute(DUCKDB_SQL.format(src=src, dst=dd))) for _ in range(REPEAT))
    # the same query as a fresh process, like `dcptool replay` (interpreter and import included)
    script = ("import duckdb; c = duckdb.connect(); c.execute('SET threads TO 2'); "
              "c.execute('SET enable_progress_bar = false'); "
              f"c.execute({DUCKDB_SQL.format(src=src, dst=dd + '.proc')!r})")
    runs = [_with_cpu(lambda: _timed(lambda: subprocess.run([sys.executable, "-c", script], check=True)))
            for _ in range(REPEAT)]
    out["duckdb_proc_s"], out["duckdb_proc_cpu_s"] = min(r[0] for r in runs), min(r[1] for r in runs)
    lo = os.path.join(workdir, f"local-{frames}-{docs}")
    runs = [_with_cpu(lambda: timed_cli(["replay", cap, "--table", "documents", "--out", lo])[0])
            for _ in range(REPEAT)]
    out["local_s"], out["local_cpu_s"] = min(r[0] for r in runs), min(r[1] for r in runs)
    if spark:
        so = os.path.join(workdir, f"spark-{frames}-{docs}")
        cold = ["replay", cap, "--master", "local[*]", "--table", "documents", "--out", so]
        if not _archive_ready(cold_env):
            # the very first embedded session writes the JVM's class archive at its exit
            # (replay/spark/cds.py); every later one maps it. Timed apart, once.
            out["spark_first_s"], _ = timed_cli(cold, env=cold_env)
            _wait_archive(cold_env)
        out["spark_s"], _ = timed_cli(cold, env=cold_env)
    if warm_env is not None:
        wo = os.path.join(workdir, f"warm-{frames}-{docs}")
        out["warm_s"] = min(timed_cli(["replay", cap, "--spark", "--table", "documents", "--out", wo],
                                      env=warm_env)[0] for _ in range(REPEAT))
    out.update(rss_columns(cap))
    # the three results are the same documents
    duck = pq.read_table(dd).sort_by([("vbucket", "ascending"), ("key", "ascending")])
    mine = pq.read_table(os.path.join(lo, "documents.parquet"))
    assert duck.num_rows == mine.num_rows, (duck.num_rows, mine.num_rows)
    for c in ("by_seqno", "state", "frame_no"):
        assert duck.column(c).to_pylist() == mine.column(c).to_pylist(), c
    if spark:
        assert pq.read_table(os.path.join(so, "documents.parquet")).equals(mine)
    if warm_env is not None:
        assert pq.read_table(os.path.join(wo, "documents.parquet")).equals(mine)
    return out


def compile_sources() -> None:
    """Our modules' bytecode, as an installed dcptool has it (pip compiles a package it
    installs; duckdb's modules, which the hand query imports, were compiled so): with
    PYTHONDONTWRITEBYTECODE set, as in this environment, every timed `dcptool` process would
    otherwise compile its modules at start (~0.05 s)."""
    import compileall
    compileall.compile_dir(str(ROOT), quiet=1, rx=__import__("re").compile(r"/(\.venv|\.synapse-venv|\.git|tests)/"))


def serve_capture(workdir: str, items: int) -> str:
    """A capture that `dcptool capture` made of `serve dcp` (64 vbuckets, `items` documents of
    512-byte JSON, `--to now`, 8 MiB segments: many of them, every column as users have them)."""
    cap = os.path.join(workdir, f"served-{items}")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    srv = subprocess.Popen([sys.executable, "-m", "dcptool.cli", "serve", "dcp", "--port", "0", "--items", str(items),
                            "--vbuckets", "64", "--value-size", "512"], stdout=subprocess.PIPE,
                           stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        addr = json.loads(srv.stdout.readline())["listening"]
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "dcptool.cli", "capture", f"couchbase://{addr}/default", "--to", "now",
                        "--rotate-size", "8MiB", "-o", cap, "--quiet"], check=True, timeout=3600, env=env)
        n = len([f for f in os.listdir(cap) if f.endswith(".parquet")])
        print(f"  captured {items:,} items of serve dcp in {time.perf_counter() - t0:.1f}s ({n} segments)", flush=True)
    finally:
        srv.terminate()
        srv.wait(60)
    return cap


def bodies_main(argv: list[str]) -> None:
    """`bench_replay.py bodies [FRAMES] [--no-spark]`: what bodies cost (tests/bench/replay_bodies.py)
    on the synthetic capture of FRAMES frames (1M) / FRAMES/10 documents, and on a capture of
    `serve dcp` with BENCH_SCALE documents (100k)."""
    from tests.bench import replay_bodies
    frames = next((int(a) for a in argv if a.isdigit()), 1_000_000)
    spark = "--no-spark" not in argv
    items = int(os.environ.get("BENCH_SCALE", "100000"))
    results = {}
    with tempfile.TemporaryDirectory(prefix="dcptool-bench-") as work:
        cap = os.path.join(work, "synthetic")
        os.makedirs(cap)
        generate(os.path.join(cap, "dcp-20251122T000000.000000Z-b0000000-000000.parquet"), frames, frames // 10)
        print(f"== bodies: synthetic capture, {frames:,} frames, {frames // 10:,} documents", flush=True)
        results["synthetic"] = replay_bodies.measure(cap, spark)
        print(replay_bodies.report("synthetic", results["synthetic"]), flush=True)
        print(f"== bodies: serve dcp capture, {items:,} documents", flush=True)
        results["served"] = replay_bodies.measure(serve_capture(work, items), spark)
        print(replay_bodies.report("serve dcp", results["served"]), flush=True)
    print(json.dumps(results))


def main(argv: list[str]) -> None:
    compile_sources()
    if "bodies" in argv:
        return bodies_main(argv)
    sizes = [int(a) for a in argv if a.isdigit()] or [1_000_000, 10_000_000]
    spark = "--no-spark" not in argv
    configs = []
    for n in sizes:
        configs.append((n, 100_000))
    if len(sizes) > 1:
        configs.append((max(sizes), 1_000_000))
    results = []
    with tempfile.TemporaryDirectory(prefix="dcptool-bench-") as work:
        warm_env = None
        if spark:
            warm_env, start_s = start_warm_server(work)
            print(f"== warm Spark Connect server started in {start_s:.1f}s (not in the times below)", flush=True)
        try:
            for frames, docs in configs:
                print(f"== {frames:,} frames, {docs:,} distinct documents", flush=True)
                r = run(frames, docs, work, spark, warm_env,
                        cold_env={"DCPTOOL_STATE_DIR": os.path.join(work, "state")})
                results.append(r)
                _print_run(r, spark)
        finally:
            if warm_env is not None:
                stop_warm_server(warm_env)
    _print_scaling(results, spark)
    print(json.dumps(results))


def _print_run(r: dict, spark: bool) -> None:
    frames = r["frames"]
    d, dp = r["duckdb_s"], r["duckdb_proc_s"]
    line = (f"  duckdb query {d:.2f}s, as a process {dp:.2f}s | local {r['local_s']:.2f}s "
            f"({r['local_s'] / dp:.2f}x the process, goal <= 1.2x; {r['local_s'] / d:.2f}x the query in a "
            f"warm process; {r['local_s'] / frames * 1e6:.2f}s/M frames)")
    if spark:
        if "spark_first_s" in r:
            line += f" | spark cold, first run ever (writes the JVM class archive) {r['spark_first_s']:.2f}s"
        line += (f" | spark cold (embedded) {r['spark_s']:.2f}s ({r['spark_s'] / d:.2f}x the query, "
                 f"{r['spark_s'] / dp:.2f}x the process; goal <= 8x)"
                 f" | spark warm (Connect) {r['warm_s']:.2f}s ({r['warm_s'] / d:.2f}x the query, "
                 f"{r['warm_s'] / dp:.2f}x the process; goal <= 4x)")
    line += (f" | CPU (user + system) local {r['local_cpu_s']:.2f}s, duckdb process {r['duckdb_proc_cpu_s']:.2f}s "
             f"({r['local_cpu_s'] / r['duckdb_proc_cpu_s']:.2f}x)")
    loc, duck, docs = r["local_rss_mib"], r["duckdb_rss_mib"], r["distinct_documents"]
    line += (f" | peak RSS local {loc:.0f} MiB, duckdb process {duck:.0f} MiB ({loc / duck:.2f}x, goal <= 1.2x; "
             f"{docs:,} documents)")
    print(line, flush=True)


def _print_scaling(results: list[dict], spark: bool) -> None:
    by_docs = [r for r in results if r["docs"] == 100_000]
    if len(by_docs) > 1:
        small, big = by_docs[0], by_docs[-1]
        engines = ["duckdb_s", "duckdb_proc_s", "local_s"] + (["spark_s", "warm_s"] if spark else [])
        print(f"== {big['frames'] / small['frames']:.0f}x the frames, time ratio per engine (goal <= 12x): "
              + ", ".join(f"{e[:-2]} {big[e] / small[e]:.1f}x" for e in engines), flush=True)
    same_docs = by_docs
    if len(same_docs) > 1:
        small, big = same_docs[0], same_docs[-1]
        scale = big["frames"] / small["frames"]
        print(f"== {scale:.0f}x the frames, same documents: local takes {big['local_s'] / small['local_s']:.1f}x "
              f"the time (linear: at most {scale * 1.2:.0f}x), peak RSS {big['local_rss_mib'] / small['local_rss_mib']:.2f}x")
    if len(results) > len(same_docs):
        many = results[-1]
        print(f"== 10x the documents, same frames: peak RSS {many['local_rss_mib'] / same_docs[-1]['local_rss_mib']:.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
