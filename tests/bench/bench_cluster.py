"""Benchmark: `dcptool capture` from `dcptool serve dcp --nodes 3` (one connection per node,
every stream routed by the cluster map) beside the same capture from one node with the same
total data, in the same run: both rates in frames/s and the cluster's as a ratio of the
single node's. Fan-out should cost almost nothing (goal: at least 0.9x; printed, not
asserted: the machine has two cores, shared by the producer and the capture).

    .venv/bin/python tests/bench/bench_cluster.py              # 1M x 128-byte mutations
    BENCH_SCALE=0.1 .venv/bin/python tests/bench/bench_cluster.py
    BENCH_REPEAT=3 BENCH_NODES=4 .venv/bin/python tests/bench/bench_cluster.py"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile

import _repo  # noqa: F401,E402  (the repository root on sys.path: tests/bench/_repo.py)

from tests.bench import bench_capture  # noqa: E402  (capture() runs and times one capture)
from tests.support.paths import DCPTOOL  # noqa: E402

SCALE = float(os.environ.get("BENCH_SCALE", "1"))
NODES = int(os.environ.get("BENCH_NODES", "3"))
ITEMS = max(1000, int(1_000_000 * SCALE))
VBUCKETS = 64


def start_server(nodes: int):
    proc = subprocess.Popen([DCPTOOL, "serve", "dcp", "--port", "0", "--items", str(ITEMS), "--vbuckets",
                             str(VBUCKETS), "--nodes", str(nodes)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    host, port = json.loads(proc.stdout.readline())["listening"].rsplit(":", 1)
    return proc, host, int(port)


def one(nodes: int) -> tuple[float, float, dict]:
    """(frames/s over the session, frames/s wall clock, summary) of one capture."""
    proc, host, port = start_server(nodes)
    tmp = tempfile.mkdtemp(prefix="bench-cluster-")
    try:
        wall, summary, _, _ = bench_capture.capture(host, port, tmp)
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return summary["frames"] / summary["seconds"], summary["frames"] / wall, summary


def main() -> None:
    print(f"{ITEMS:,} mutations of ~128 B, {VBUCKETS} vbuckets")
    for _ in range(int(os.environ.get("BENCH_REPEAT", "1"))):
        single, single_wall, s1 = one(1)
        cluster, cluster_wall, s3 = one(NODES)
        print(f"  one node:        {single:12,.0f} frames/s  ({single_wall:,.0f}/s wall)  "
              f"{s1['connections']} connection(s)")
        print(f"  {NODES} nodes:         {cluster:12,.0f} frames/s  ({cluster_wall:,.0f}/s wall)  "
              f"{s3['connections']} connection(s)")
        print(f"  ratio cluster/one node: {cluster / single:.2f}x (wall {cluster_wall / single_wall:.2f}x); "
              "goal >= 0.9x")


if __name__ == "__main__":
    main()
