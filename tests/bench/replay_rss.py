"""Peak RSS of the in-process replay (DuckDB running the plan of replay/rules/plans.py, inside
`dcptool replay`) next to DuckDB's query by hand, on the same capture and query.

`measure(capture_dir)` runs, each in a fresh child process, `dcptool replay DIR --table
documents --out TMP` (the local engine) and bench_replay.py's DuckDB query (same Parquet,
same `documents`), and returns their peak RSS in MiB (the child's own VmHWM, read as it
exits) and the number of distinct documents (rows of `documents`).

As a script it generates captures with bench_replay.py's generator (100k and 1M distinct
documents; 10M frames unless told otherwise) and prints, per capture, both peaks, the ratio
local / DuckDB (goal <= 1.2x), the bytes per document above a 300 MiB base (goal <= 400), and
from the two captures together the measured cost of one more document and the fixed base it
implies (goal <= 300 MiB).

    .venv/bin/python tests/bench/replay_rss.py                 # 10M frames
    .venv/bin/python tests/bench/replay_rss.py 2000000         # frames per capture
    .venv/bin/python tests/bench/replay_rss.py --dir CAPTURE   # one existing capture
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.support.paths import ROOT  # noqa: E402

BASE_MIB = 300            # the fixed base the goal allows
DOC_GOAL = 400            # bytes per distinct document above it


def _duckdb_sql() -> str:
    """bench_replay.py's query, so both always run the same one."""
    from tests.bench import bench_replay
    return bench_replay.DUCKDB_SQL


# run in the child: its own VmHWM when it exits. The child's ru_maxrss would not do: Linux
# starts it from the parent's resident size at the fork, so a big parent shows in it.
_WRAP = """
import atexit, runpy, sys
def _hwm(path=sys.argv[1]):
    with open("/proc/self/status") as f:
        kib = next(int(l.split()[1]) for l in f if l.startswith("VmHWM"))
    with open(path, "w") as out:
        out.write(str(kib))
atexit.register(_hwm)
mode, target, sys.argv = sys.argv[2], sys.argv[3], sys.argv[3:]
if mode == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(compile(target, "<bench>", "exec"), {"__name__": "__main__"})
"""


def child_peak(argv: list[str], env: dict | None = None) -> tuple[float, float]:
    """Runs `python -m MODULE ARGS` or `python -c CODE` (argv without the interpreter); its
    wall seconds and peak RSS in MiB (VmHWM of the child itself)."""
    with tempfile.NamedTemporaryFile(prefix="dcptool-hwm-", delete=False) as f:
        path = f.name
    try:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-c", _WRAP, path, *argv], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
        wall = time.perf_counter() - t0
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:4])} ... failed: {p.stderr.decode().strip()[-500:]}")
        with open(path) as f:
            return wall, int(f.read()) / 1024
    finally:
        os.remove(path)


def parquet_of(capture_dir: str) -> list[str]:
    return sorted(os.path.join(capture_dir, n) for n in os.listdir(capture_dir) if n.endswith(".parquet"))


def measure_full(capture_dir: str, threads: int = 2) -> dict:
    """Peak RSS (MiB) and wall seconds of the local engine and of DuckDB on `capture_dir`,
    and the distinct documents."""
    import pyarrow.parquet as pq
    with tempfile.TemporaryDirectory(prefix="dcptool-rss-") as tmp:
        out = os.path.join(tmp, "local")
        local_s, local_mib = child_peak(["-m", "dcptool.cli", "replay", capture_dir, "--table", "documents",
                                         "--out", out])
        docs = pq.ParquetFile(os.path.join(out, "documents.parquet")).metadata.num_rows
        srcs = parquet_of(capture_dir)
        src = srcs[0] if len(srcs) == 1 else os.path.join(capture_dir, "*.parquet")
        sql = _duckdb_sql().format(src=src, dst=os.path.join(tmp, "duck.parquet"))
        script = f"import duckdb; c = duckdb.connect(); c.execute('SET threads TO {threads}'); c.execute({sql!r})"
        duck_s, duck_mib = child_peak(["-c", script])
    return {"local_mib": local_mib, "duckdb_mib": duck_mib, "local_s": local_s, "duckdb_s": duck_s,
            "distinct_documents": docs}


def measure(capture_dir: str) -> dict:
    """bench_replay.py's columns: {name: MiB} (and the distinct documents)."""
    m = measure_full(capture_dir)
    return {"local_peak_mib": m["local_mib"], "duckdb_peak_mib": m["duckdb_mib"],
            "distinct_documents": m["distinct_documents"]}


def report(name: str, m: dict) -> str:
    per_doc = (m["local_mib"] - BASE_MIB) * 2**20 / max(m["distinct_documents"], 1)
    return (f"{name}: {m['distinct_documents']:,} documents | local {m['local_mib']:.0f} MiB "
            f"({m['local_s']:.2f}s), duckdb {m['duckdb_mib']:.0f} MiB ({m['duckdb_s']:.2f}s), "
            f"local/duckdb {m['local_mib'] / m['duckdb_mib']:.2f}x (goal <= 1.2x) | "
            f"{per_doc:.0f} bytes/document above a {BASE_MIB} MiB base (goal <= {DOC_GOAL})")


def main(argv: list[str]) -> None:
    if "--dir" in argv:
        d = argv[argv.index("--dir") + 1]
        print(report(d, measure_full(d)), flush=True)
        return
    frames = next((int(a) for a in argv if a.isdigit()), 10_000_000)
    from tests.bench.bench_replay import generate
    runs = []
    with tempfile.TemporaryDirectory(prefix="dcptool-rss-") as work:
        for docs in (100_000, 1_000_000):
            cap = os.path.join(work, f"cap-{frames}-{docs}")
            os.makedirs(cap)
            generate(os.path.join(cap, "dcp-20251122T000000.000000Z-b0000000-000000.parquet"), frames, docs)
            m = measure_full(cap)
            runs.append(m)
            print(report(f"{frames:,} frames", m), flush=True)
            os.remove(parquet_of(cap)[0])
    (a, b) = runs
    slope = (b["local_mib"] - a["local_mib"]) * 2**20 / (b["distinct_documents"] - a["distinct_documents"])
    base = a["local_mib"] - slope * a["distinct_documents"] / 2**20
    print(f"local engine: {slope:.0f} bytes per additional document (goal <= {DOC_GOAL}), "
          f"fixed base {base:.0f} MiB (goal <= {BASE_MIB})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
