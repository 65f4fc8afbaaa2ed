"""One random topology schedule with the official Couchbase SDK writing (issue 25's property,
tests/protocol/dcp/test_chaos.py and tests/bench/bench_chaos.py): an in-process `serve dcp`
cluster of an empty bucket runs the schedule (tests/support/chaos_run.py's machinery) while
the SDK writes a seeded mix (upserts, inserts, CAS replaces, removes, touches, durable
upserts at the three levels) and `dcptool capture` records the bucket from one seed,
SIGKILLed at a seeded write and resumed (`--resume`, following); the SDK keeps writing until
every event of the schedule fired, then the server ends every stream at the bucket's high
seqno (`ServerModel.drain`: the resumed capture finishes with all of it), and then:

- the replayed `documents` equal what the SDK reads back, key for key and CAS for CAS;
- no acknowledged durable write is missing (a key whose last write was an acknowledged
  durable one reads back with that CAS);
- the producer's invariants held after every event.

An SDK write the schedule made fail (a timeout on a hung node, an ambiguous durable write)
is uncertain: only the read-back says what became of it. A failing seed reproduces with
`run_sdk_schedule(tmp, seed, chaos.from_json(LINE))` or `serve dcp --schedule FILE`."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import time
from datetime import timedelta

from couchbase import exceptions as cbe
from couchbase.auth import PasswordAuthenticator
from couchbase.cluster import Cluster
from couchbase.diagnostics import ServiceType
from couchbase.durability import DurabilityLevel, ServerDurability
from couchbase.options import (
    ClusterOptions,
    ClusterTimeoutOptions,
    ReplaceOptions,
    UpsertOptions,
    WaitUntilReadyOptions,
)

from dcptool.protocol.dcp.server import chaos
from dcptool.protocol.dcp.server import producer as P
from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import find_captures
from tests.support.chaos_run import BOUND, LOSS
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

USER, PASSWORD = "Administrator", "chaos-sdk-pw"
ENV = dict(os.environ, DCPTOOL_PASSWORD=PASSWORD)
WRITES = 120                 # per schedule, before the fillers that let every event fire
KEYS = [f"k-{i:03d}" for i in range(120)]
LEVELS = (DurabilityLevel.MAJORITY, DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
          DurabilityLevel.PERSIST_TO_MAJORITY)
KINDS = ("upsert", "insert", "replace", "remove", "touch", "durable")
REFUSED = (cbe.DocumentExistsException, cbe.DocumentNotFoundException, cbe.CasMismatchException)


def connect(host: str, port: int, *, password: str = PASSWORD, kv_timeout: float = 1.0,
            durable_timeout: float = 2.0, connect_timeout: float = 10.0):
    """The official SDK connected to `serve dcp` at host:port as USER, its KV service ready:
    (cluster, the default collection). The cluster map is polled every 200 ms (the SDK's
    default is 2.5 s) so that it follows a topology change at once; the timeouts are seconds
    (the chaos schedules' short ones by default: a write to a hung node is uncertain soon)."""
    timeouts = ClusterTimeoutOptions(kv_timeout=timedelta(seconds=kv_timeout),
                                     kv_durable_timeout=timedelta(seconds=durable_timeout),
                                     connect_timeout=timedelta(seconds=connect_timeout))
    opts = ClusterOptions(PasswordAuthenticator(USER, password), config_poll_interval=timedelta(milliseconds=200),
                          timeout_options=timeouts)
    cluster = Cluster(f"couchbase://{host}:{port}", opts)
    cluster.wait_until_ready(timedelta(seconds=connect_timeout),
                             WaitUntilReadyOptions(service_types=[ServiceType.KeyValue]))
    return cluster, cluster.bucket("default").default_collection()


class Mix:
    """The seeded write mix. `last[key]` = (kind, cas or None, outcome) of the key's latest
    attempt: outcome "ok", "refused" (the server said no: nothing changed) or "uncertain"."""

    def __init__(self, coll, seed: int):
        self.coll, self.rng = coll, random.Random(f"sdk:{seed}")
        self.cas: dict[str, int] = {}       # the newest CAS the SDK was given per key
        self.last: dict[str, tuple[str, int | None, str]] = {}
        self.counts: dict[str, int] = {}
        self.sent: dict[tuple[str, int], int] = {}   # (key, cas) -> wall clock ns when it was sent

    def write(self, key: str | None = None) -> None:
        rng, coll = self.rng, self.coll
        key = key or rng.choice(KEYS)
        doc = {"k": key, "r": rng.randrange(1 << 30)}
        roll = rng.random()
        cas = None
        kind = ("upsert" if roll < 0.3 else "insert" if roll < 0.45 else "replace" if roll < 0.6
                else "remove" if roll < 0.72 else "touch" if roll < 0.82 else "durable")
        level = rng.choice(LEVELS) if kind == "durable" else None
        t_ns = time.time_ns()
        try:
            if kind == "upsert":
                cas = coll.upsert(key, doc).cas
            elif kind == "insert":
                cas = coll.insert(key, doc).cas
            elif kind == "replace":     # the CAS last seen: stale when a failover or a remove came between
                cas = coll.replace(key, doc, ReplaceOptions(cas=self.cas.get(key, 1))).cas
            elif kind == "remove":
                coll.remove(key)
            elif kind == "touch":
                cas = coll.touch(key, timedelta(hours=1)).cas
            else:
                cas = coll.upsert(key, doc, UpsertOptions(durability=ServerDurability(level))).cas
            outcome = "ok"
        except REFUSED:
            outcome = "refused"
        except cbe.CouchbaseException:
            outcome = "uncertain"
        if cas is not None:
            self.cas[key] = cas
            self.sent[(key, cas)] = t_ns
        if outcome != "refused":
            self.last[key] = (kind, cas, outcome)
        name = f"{kind}-{outcome}"
        self.counts[name] = self.counts.get(name, 0) + 1

    def read_back(self) -> dict[str, int]:
        truth = {}
        for key in KEYS:
            try:
                truth[key] = self.coll.get(key).cas
            except cbe.DocumentNotFoundException:
                pass
        return truth


def _capture(url: str, out, *args) -> list[str]:
    return [DCPTOOL, "capture", url, "-o", str(out), "--quiet", "--user", USER, "--timeout", "5s",
            "--noop-interval", "1s", *args]


class _Pace:
    """A steady `rate` of writes per second (0: no pause)."""

    def __init__(self, rate: float):
        self.rate, self.n, self.start = rate, 0, time.monotonic()

    def wait(self) -> None:
        if self.rate:
            pause = self.start + self.n / self.rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        self.n += 1


def _streaming(srv) -> bool:
    async def ask():
        return any(p.conn is not None and p.conn.streams for p in srv.server.protocols)
    return asyncio.run_coroutine_threadsafe(ask(), srv.loop).result(BOUND)


def _drain(srv) -> None:
    def go():
        srv.server.model.drain = True
        for p in list(srv.server.protocols):
            p.wake.set()
    srv.loop.call_soon_threadsafe(go)


def replayed(out) -> dict[str, int]:
    """The replayed live documents: key -> cas."""
    got = {}
    for d in local.replay_local(find_captures([str(out)])).table("documents").to_pylist():
        if d["state"] == "live":
            key = d["key"].decode() if isinstance(d["key"], bytes) else d["key"]
            got[key] = d["cas"]
    return got


def latencies(out, sent: dict[tuple[str, int], int], kill_ns: int) -> tuple[list[float], list[float]]:
    """ms from each write's send to its frame's receive `ts` in the capture (its first one):
    (every write, the writes the capture running when they were sent received: before the
    SIGKILL at `kill_ns` by the first run, after the resumed run's first frame by it)."""
    from dcptool.replay.store.reader import read_capture_table
    t = read_capture_table(find_captures([str(out)]), ["capture_id", "direction", "op", "key", "cas", "ts"])
    seen, first = {}, {}
    for r in t.to_pylist():
        ts = r["ts"].value if hasattr(r["ts"], "value") else int(r["ts"].timestamp() * 1e9)
        first.setdefault(r["capture_id"], ts)
        if r["direction"] == "in" and r["op"] in ("mutation", "deletion", "commit") and r["key"] is not None:
            key = r["key"].decode() if isinstance(r["key"], bytes) else r["key"]
            t_ns = sent.get((key, r["cas"]))
            if t_ns is not None and (key, r["cas"]) not in seen:
                seen[(key, r["cas"])] = (t_ns, ts, r["capture_id"])
    runs = sorted(first, key=first.get)
    every, steady = [], []
    for t_ns, ts, cid in seen.values():
        every.append((ts - t_ns) / 1e6)
        if (cid == runs[0] and t_ns < kill_ns) or (cid != runs[0] and t_ns >= first[cid]):
            steady.append((ts - t_ns) / 1e6)
    return every, steady


def run_sdk_schedule(tmp_path, seed: int, schedule: chaos.Schedule | None = None, writes: int = WRITES,
                     vbuckets: int = 16, rate: float = 0.0, latency: list | None = None):
    """One schedule end to end with SDK writes; asserts the property and returns (model, mix).
    `rate`: writes per second (0: as fast as the SDK goes). With `latency` (a list), the
    write-to-capture latency of each write, in ms, is appended."""
    sched = schedule or chaos.draw(seed, 3, 1, writes // 2, LOSS)   # (frames: the live writes, some deduplicated)
    model = P.server_from_options(vbuckets=vbuckets, items=0, seed=seed, nodes=3, replicas=1,
                                  users={USER: PASSWORD}, scenarios=P.Scenarios(failover_loss=LOSS))
    cl = chaos.install(model, sched, seed, LOSS)
    kill_at = random.Random(f"kill:{seed}").randrange(writes // 5, writes * 4 // 5)
    out = tmp_path / f"sdk{seed}"
    where = f"seed {seed} {sched.to_json()}"
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        proc = subprocess.Popen(_capture(url, out, "--to", "forever"), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=ENV)
        t0 = time.monotonic()
        deadline = t0 + BOUND
        while model.stream_frames == 0 and not _streaming(srv):   # the capture streams: the writes go live
            assert time.monotonic() < deadline and proc.poll() is None, f"{where}: the capture never streamed"
            time.sleep(0.01)
        cluster, coll = connect(srv.host, srv.port)
        timing = {"connect": time.monotonic() - t0}
        try:
            mix = Mix(coll, seed)
            pace = _Pace(rate)
            kill_ns = 0
            for i in range(writes):
                pace.wait()
                if i == kill_at:
                    kill_ns = time.time_ns()
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(BOUND)
                    proc.stderr.close()
                    proc = subprocess.Popen(_capture(url, out, "--resume", "--to", "forever"),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV)
                mix.write()
            timing["writes"] = time.monotonic() - t0
            deadline = time.monotonic() + BOUND
            while len(cl.changes) < len(sched.events) and cl.broken is None:   # the schedule runs to its end
                assert time.monotonic() < deadline and proc.poll() is None, f"{where}: stuck at {len(cl.changes)} events"
                if not _streaming(srv):   # fillers drive frames only once the resumed capture streams
                    time.sleep(0.01)      # (polling, bounded by the deadline)
                    continue
                pace.wait()
                mix.write()
            timing["fill"] = time.monotonic() - t0
            _drain(srv)                 # every stream ends at the bucket's high seqno: the capture finishes
            _, err = proc.communicate(timeout=BOUND)
            assert proc.returncode == 0, f"{where}: {err.decode()}"
            timing["resume"] = time.monotonic() - t0
            truth = mix.read_back()
        finally:
            cluster.close()
            if proc.poll() is None:
                proc.kill()
                proc.wait(BOUND)
    assert cl.broken is None, cl.broken
    assert {n.rsplit("-", 1)[0] for n in mix.counts} == set(KINDS), f"{where}: the mix lacked a kind {mix.counts}"
    got = replayed(out)
    diff = {k: (got.get(k), truth.get(k)) for k in set(got) | set(truth) if got.get(k) != truth.get(k)}
    assert not diff, f"{where}: key: (replayed, read back) {diff}"
    for key, (kind, cas, outcome) in mix.last.items():
        if kind == "durable" and outcome == "ok":
            assert truth.get(key) == cas, f"{where}: acknowledged durable write of {key} lost"
    timing["replay"] = time.monotonic() - t0
    mix.timing = timing
    mix.steady_latency = []
    if latency is not None:
        every, mix.steady_latency = latencies(out, mix.sent, kill_ns)
        latency.extend(every)
    return model, mix
