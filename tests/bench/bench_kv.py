"""Benchmark: the official Couchbase Python SDK writing into `dcptool serve dcp --items 0`
(1 node, and 3 nodes with a replica) while `dcptool capture --to forever` records the
bucket: upserts per second through the SDK's batch API (`upsert_multi`) and one at a time,
and the latency from an SDK write to its frame in the capture (p50 / p99, the capture's
receive `ts` minus the moment the write was sent) at a steady 2k writes/s.

    .venv/bin/python tests/bench/bench_kv.py
    BENCH_WRITES=50000 BENCH_NODES=1 .venv/bin/python tests/bench/bench_kv.py

Goals (issue 25, printed, not asserted): >= 10k upserts/s through the batch API (the SDK
process the bottleneck, not the server); write-to-capture p99 <= 50 ms at 2k writes/s.
The server's own CPU time over the throughput run is printed too (user + system seconds
of the `serve dcp` process per second of the run, from /proc), and the CPU time per write of
the server, the SDK process and the capture: on a loaded host the rates measure the run
queue, the CPU per write says which process would be the bottleneck on its own core."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.diagnostics import ServiceType
from couchbase.options import (
    ClusterOptions,
    ClusterTimeoutOptions,
    WaitUntilReadyOptions,
)

from dcptool.replay.store.reader import find_captures, read_capture_table

BIN = os.path.join(os.path.dirname(sys.executable), "dcptool")
USER, PASSWORD = "Administrator", "bench-pw"
ENV = dict(os.environ, DCPTOOL_PASSWORD=PASSWORD)
WRITES = int(os.environ.get("BENCH_WRITES", "20000"))
NODES = [int(x) for x in os.environ.get("BENCH_NODES", "1,3").split(",")]
RATE = 2000            # writes/s of the latency run
BATCH = 20             # documents per upsert_multi in the latency run (every 10 ms)
LATENCY_SECONDS = 5


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(nodes: int, out: str):
    srv = subprocess.Popen([BIN, "serve", "dcp", "--items", "0", "--port", "0", "--user", USER,
                            "--nodes", str(nodes), "--replicas", "1" if nodes > 1 else "0"],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=ENV)
    addr = json.loads(srv.stdout.readline())["listening"]
    cap = subprocess.Popen([BIN, "capture", f"couchbase://{addr}/default", "--user", USER, "--to", "forever",
                            "-o", out, "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
    opts = ClusterOptions(PasswordAuthenticator(USER, PASSWORD),
                          timeout_options=ClusterTimeoutOptions(kv_timeout=timedelta(seconds=30)))
    cluster = Cluster(f"couchbase://{addr}", opts)
    cluster.wait_until_ready(timedelta(seconds=30), WaitUntilReadyOptions(service_types=[ServiceType.KeyValue]))
    return srv, cap, cluster


def throughput(coll, srv_pid: int, cap_pid: int) -> tuple[float, float, float, dict]:
    """(upserts/s through upsert_multi, one at a time, server CPU share in the batch run,
    CPU microseconds per write of the server, the SDK process and the capture in it)."""
    docs = {f"t-{i:07d}": {"i": i, "pad": "x" * 40} for i in range(WRITES)}
    keys = list(docs)
    cpu0, sdk0, cap0, t0 = cpu_seconds(srv_pid), time.process_time(), cpu_seconds(cap_pid), time.perf_counter()
    for i in range(0, WRITES, 1000):
        res = coll.upsert_multi({k: docs[k] for k in keys[i:i + 1000]})
        assert res.all_ok, res.exceptions
    batch_s = time.perf_counter() - t0
    per_write = {"server": (cpu_seconds(srv_pid) - cpu0) / WRITES * 1e6,
                 "SDK": (time.process_time() - sdk0) / WRITES * 1e6,
                 "capture": (cpu_seconds(cap_pid) - cap0) / WRITES * 1e6}
    cpu = (cpu_seconds(srv_pid) - cpu0) / batch_s
    n = min(WRITES, 5000)
    t0 = time.perf_counter()
    for k in keys[:n]:
        coll.upsert(k, docs[k])
    single = n / (time.perf_counter() - t0)
    return WRITES / batch_s, single, cpu, per_write


def paced(coll) -> tuple[dict[tuple[str, int], int], list[float]]:
    """RATE writes/s for LATENCY_SECONDS: ({(key, cas): send time ns}, the SDK's round trip
    of each batch in ms: what the client side adds to the latency)."""
    sent = {}
    rtt = []
    period = BATCH / RATE
    start = time.perf_counter()
    for b in range(int(LATENCY_SECONDS * RATE / BATCH)):
        due = start + b * period
        delay = due - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        batch = {f"l-{b:05d}-{j:02d}": {"b": b, "j": j} for j in range(BATCH)}
        t_ns = time.time_ns()
        res = coll.upsert_multi(batch)
        rtt.append((time.time_ns() - t_ns) / 1e6)
        for key, r in res.results.items():
            sent[(key, r.cas)] = t_ns
    return sent, sorted(rtt)


def pct(sorted_ms: list[float], q: float) -> float:
    return sorted_ms[min(len(sorted_ms) - 1, int(q * len(sorted_ms)))]


def run(nodes: int) -> None:
    out = tempfile.mkdtemp(prefix="bench_kv_")
    srv, cap, cluster = start(nodes, out)
    try:
        coll = cluster.bucket("default").default_collection()
        multi, single, cpu, per_write = throughput(coll, srv.pid, cap.pid)
        sent, rtt = paced(coll)
        time.sleep(2.0)                   # let the capture receive the last writes
    finally:
        cluster.close()
        cap.send_signal(signal.SIGINT)
        cap.wait(120)
        srv.terminate()
        srv.wait(60)
    t = read_capture_table(find_captures([out])).select(["direction", "op", "key", "cas", "ts"])
    lat = []
    for r in t.to_pylist():
        if r["direction"] == "in" and r["op"] == "mutation" and r["key"] is not None:
            key = r["key"].decode() if isinstance(r["key"], bytes) else r["key"]
            t_ns = sent.get((key, r["cas"]))
            if t_ns is not None:
                ts = r["ts"].value if hasattr(r["ts"], "value") else int(r["ts"].timestamp() * 1e9)
                lat.append((ts - t_ns) / 1e6)
    lat.sort()
    shutil.rmtree(out, ignore_errors=True)
    print(f"nodes={nodes}: upsert_multi {multi:,.0f}/s (server CPU {cpu:.2f} core; CPU per write: "
          + ", ".join(f"{k} {v:.0f} us" for k, v in per_write.items())
          + f"), one at a time {single:,.0f}/s; "
          f"latency at {RATE}/s: {len(lat)}/{len(sent)} writes captured, "
          f"p50 {pct(lat, 0.5):.1f} ms, p99 {pct(lat, 0.99):.1f} ms, max {lat[-1]:.1f} ms "
          f"(the SDK's own round trip per batch: p50 {pct(rtt, 0.5):.1f} ms, p99 {pct(rtt, 0.99):.1f} ms); "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores" if lat else
          f"nodes={nodes}: no write captured")


if __name__ == "__main__":
    for n in NODES:
        run(n)
