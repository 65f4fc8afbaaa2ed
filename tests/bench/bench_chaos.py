"""Soak: random topology schedules (`serve dcp --chaos SEED`) while the official Couchbase
SDK writes a seeded mix at a steady rate (tests/support/chaos_sdk.py: upserts, inserts, CAS
replaces, removes, touches, durable upserts) and `dcptool capture` records the bucket, each
capture SIGKILLed and resumed at a seeded write; the replayed `documents` equal what the SDK
reads back, key for key and CAS for CAS, and no acknowledged durable write is lost
(tests/protocol/dcp/test_chaos.py's property). Prints the schedules run, the kinds of event
that fired, the time per schedule, every failure with its seed and schedule line (replay
one: `serve dcp ... --schedule FILE`), and the latency from an SDK write to its frame in the
capture (p50 / p99): of every write, and of the writes made while the capture was streaming
(not in the seconds a SIGKILLed capture took to come back).

    .venv/bin/python tests/bench/bench_chaos.py                   # 200 schedules, seeds 1000..1199
    BENCH_COUNT=20 BENCH_FIRST=0 .venv/bin/python tests/bench/bench_chaos.py
    BENCH_RATE=500 BENCH_WRITES=300 BENCH_JOBS=2 .venv/bin/python tests/bench/bench_chaos.py
    BENCH_SDK=0 .venv/bin/python tests/bench/bench_chaos.py       # the generator's items, no SDK

Exit 0 when every schedule passed, 1 otherwise."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from dcptool.protocol.dcp.server import chaos  # noqa: E402
from tests.support.chaos_run import LOSS, run_schedule  # noqa: E402

SDK = os.environ.get("BENCH_SDK", "1") != "0"
RATE = float(os.environ.get("BENCH_RATE", "300"))       # SDK writes per second, steady
WRITES = int(os.environ.get("BENCH_WRITES", "240"))     # per schedule (more until every event fired)
COUNT = int(os.environ.get("BENCH_COUNT", "200"))
FIRST = int(os.environ.get("BENCH_FIRST", "1000"))
ITEMS = int(os.environ.get("BENCH_ITEMS", "800"))
VBUCKETS = int(os.environ.get("BENCH_VBUCKETS", "16"))
JOBS = int(os.environ.get("BENCH_JOBS", "1"))
LATENCY: list[float] = []       # ms, every SDK write found in its capture
STEADY: list[float] = []        # ms, the writes made while the capture was streaming


def one(seed: int):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"chaos{seed}-"))
    t = time.monotonic()
    try:
        if SDK:
            from tests.support.chaos_sdk import run_sdk_schedule
            lat: list = []
            model, mix = run_sdk_schedule(tmp, seed, writes=WRITES, vbuckets=VBUCKETS, rate=RATE, latency=lat)
            LATENCY.extend(lat)
            STEADY.extend(mix.steady_latency)
        else:
            model, _ = run_schedule(tmp, seed, items=ITEMS, vbuckets=VBUCKETS)
        return seed, time.monotonic() - t, [c.kind for c in model.cluster.changes], None
    except BaseException as exc:  # noqa: BLE001 - a failure is a result here
        text = str(exc).strip().splitlines()
        said = [ln for ln in text if ln.startswith("dcptool:")]     # the capture's error line
        line = said[-1] if said else text[0] if text else ""
        return seed, time.monotonic() - t, [], f"{type(exc).__name__}: {line[:300]}"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    seeds = list(range(FIRST, FIRST + COUNT))
    fired, times, failures = Counter(), [], []
    started = time.monotonic()
    with ThreadPoolExecutor(JOBS) as pool:
        for seed, took, kinds, err in pool.map(one, seeds):
            times.append(took)
            fired.update(kinds)
            mark = "FAIL" if err else "ok"
            print(f"seed {seed}: {mark} {took:.1f}s {','.join(kinds) or '-'}", flush=True)
            if err:
                sched = chaos.draw(seed, 3, 1, WRITES // 2 if SDK else ITEMS * 6 // 5, LOSS)
                failures.append((seed, sched.to_json(), err))
    times.sort()
    what = f"SDK writes at {RATE:.0f}/s, {WRITES}+ each" if SDK else f"{ITEMS} items"
    print(f"\nschedules run: {len(seeds)} ({what}, {VBUCKETS} vbuckets, 3 nodes, 1 replica) "
          f"in {time.monotonic() - started:.0f} s; per schedule p50 {times[len(times) // 2]:.1f} s, "
          f"max {times[-1]:.1f} s")
    print("events fired: " + ", ".join(f"{k} {n}" for k, n in sorted(fired.items())))
    missing = set(chaos.KINDS) - set(fired)
    if missing:
        print("kinds never fired: " + ", ".join(sorted(missing)))
    for name, lat in (("every write", LATENCY), ("while the capture streamed", STEADY)):
        if lat:
            lat.sort()
            print(f"write-to-capture latency, {name}: {len(lat)} writes, p50 {lat[len(lat) // 2]:.1f} ms, "
                  f"p99 {lat[int(len(lat) * 0.99)]:.1f} ms, max {lat[-1]:.1f} ms")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"failures: {len(failures)}")
    for seed, line, err in failures:
        print(f"  seed {seed}: {err}\n    schedule: {line}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
