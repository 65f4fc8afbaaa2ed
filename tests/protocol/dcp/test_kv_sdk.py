"""The official Couchbase Python SDK (PyPI `couchbase`, on Couchbase's C++ core) against
`dcptool serve dcp --items 0`, one node and a 3-node cluster with a replica: a seeded mix of
upserts, inserts (one on an existing key: DocumentExistsException), CAS replaces (a stale
CAS: CasMismatchException), removes, touches, counters, append / prepend, a lock and durable
upserts (majority: acknowledged
with --replicas 1, DurabilityImpossibleException with --replicas 0). A `dcptool stream --to
forever` open during the writes gets the last change of every key; then `dcptool capture
... --to now` and `dcptool replay CAP --table documents` (in-process): the replayed live
documents equal what the SDK reads back, key for key and CAS for CAS. Across a rebalance and
a hard failover the SDK follows the map, no acknowledged durable write is lost and plain
ones at most --failover-loss per vbucket."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

couchbase = pytest.importorskip("couchbase")

from couchbase import exceptions as cbe  # noqa: E402
from couchbase.durability import DurabilityLevel, ServerDurability  # noqa: E402
from couchbase.options import (  # noqa: E402
    DecrementOptions,
    DeltaValue,
    GetOptions,
    IncrementOptions,
    ReplaceOptions,
    SignedInt64,
    UpsertOptions,
)
from couchbase.transcoder import RawBinaryTranscoder  # noqa: E402

from tests.support.chaos_sdk import connect as sdk_connect  # noqa: E402

pytestmark = pytest.mark.integration
DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
USER, PASSWORD = "Administrator", "kv-sdk-pw"
ENV = dict(os.environ, DCPTOOL_PASSWORD=PASSWORD)
BOUND = 120
KEYS = [f"user-{i:03d}" for i in range(40)]
LOCKED_RETRIES = 1   # seconds the SDK retries a write to a locked document (the KV timeout, 10 s, otherwise)


@pytest.fixture
def serve():
    procs = []

    def start(*args):
        p = subprocess.Popen([DCPTOOL, "serve", "dcp", "--items", "0", "--port", "0", "--vbuckets", "16",
                              "--user", USER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=ENV)
        procs.append(p)
        line = p.stdout.readline()
        assert line, p.stderr.read()
        return json.loads(line)["listening"]

    yield start
    for p in procs:
        p.terminate()
        p.wait(BOUND)


def connect(addr: str):
    """The SDK connected as tests/support/chaos_sdk.py connects it, with timeouts long enough
    that every write of the workload gets its answer on a loaded machine."""
    host, port = addr.rsplit(":", 1)
    return sdk_connect(host, int(port), password=PASSWORD, kv_timeout=10.0, durable_timeout=10.0,
                       connect_timeout=20.0)


def workload(coll, seed: int, durable_ok: bool) -> dict:
    """A seeded mix of writes; every outcome checked against a model of the bucket.
    Returns the counts of what happened."""
    rng = random.Random(seed)
    keys = KEYS
    exists: dict[str, int] = {}          # key -> CAS the SDK was given
    counts: dict[str, int] = {}
    durable = ServerDurability(DurabilityLevel.MAJORITY)
    for step in range(300):
        key = rng.choice(keys)
        doc = {"k": key, "step": step, "r": rng.randrange(1 << 30)}
        roll = rng.random()
        if roll < 0.35:
            what, res = "upsert", coll.upsert(key, doc)
        elif roll < 0.5:
            what = "insert"
            if key in exists:
                with pytest.raises(cbe.DocumentExistsException):
                    coll.insert(key, doc)
                what, res = "insert-exists", None
            else:
                res = coll.insert(key, doc)
        elif roll < 0.65:
            if key not in exists:
                with pytest.raises(cbe.DocumentNotFoundException):
                    coll.replace(key, doc)
                what, res = "replace-missing", None
            elif rng.random() < 0.3:
                with pytest.raises(cbe.CasMismatchException):
                    coll.replace(key, doc, ReplaceOptions(cas=exists[key] - 1))
                what, res = "replace-stale", None
            else:
                what, res = "replace", coll.replace(key, doc, ReplaceOptions(cas=exists[key]))
        elif roll < 0.77:
            if key not in exists:
                with pytest.raises(cbe.DocumentNotFoundException):
                    coll.remove(key)
                what, res = "remove-missing", None
            else:
                coll.remove(key)
                del exists[key]
                what, res = "remove", None
        elif roll < 0.87:
            if key not in exists:
                what, res = "touch-missing", None
                with pytest.raises(cbe.DocumentNotFoundException):
                    coll.touch(key, timedelta(hours=1))
            else:
                what, res = "touch", coll.touch(key, timedelta(hours=1))
        elif durable_ok:
            what, res = "durable", coll.upsert(key, doc, UpsertOptions(durability=durable))
        else:
            with pytest.raises(cbe.DurabilityImpossibleException):
                coll.upsert(key, doc, UpsertOptions(durability=durable))
            what, res = "durable-impossible", None
        if res is not None:
            assert res.cas > exists.get(key, 0)     # the hybrid logical clock only moves on
            exists[key] = res.cas
        counts[what] = counts.get(what, 0) + 1
    binary = coll.binary()                             # counters and append / prepend
    for i in range(6):
        r = binary.increment(f"ctr-{i % 2}", IncrementOptions(initial=SignedInt64(10), delta=DeltaValue(i + 1)))
        exists[f"ctr-{i % 2}"] = r.cas
    assert binary.decrement("ctr-0", DecrementOptions(delta=DeltaValue(1000))).content == 0
    assert coll.get("ctr-1").content_as[int] == 10 + 4 + 6
    raw = RawBinaryTranscoder()
    coll.upsert("bin", b"mid", UpsertOptions(transcoder=raw))
    binary.append("bin", b"-end")
    exists["bin"] = binary.prepend("bin", b"start-").cas
    exists["ctr-0"] = coll.get("ctr-0").cas
    assert coll.get("bin", GetOptions(transcoder=raw)).value == b"start-mid-end"
    locked = next(k for k in keys if k in exists)      # a lock: only its CAS writes
    lock = coll.get_and_lock(locked, timedelta(seconds=15)).cas
    with pytest.raises(cbe.DocumentLockedException):   # (the SDK retries LOCKED until its timeout)
        coll.upsert(locked, {"locked": True}, UpsertOptions(timeout=timedelta(seconds=LOCKED_RETRIES)))
    exists[locked] = coll.replace(locked, {"unlocked": True}, ReplaceOptions(cas=lock)).cas
    for key in keys + ["ctr-0", "ctr-1", "bin"]:       # the SDK reads back what it was told
        if key in exists:
            assert coll.get(key).cas == exists[key]
        else:
            assert not coll.exists(key).exists
    counts["live"] = len(exists)
    return counts, exists


def replayed_documents(addr: str, tmp_path) -> dict:
    out = tmp_path / "cap"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cap = subprocess.run([DCPTOOL, "capture", f"couchbase://{addr}/default", "--user", USER, "--to", "now",
                          "-o", str(out), "--quiet"], capture_output=True, text=True, timeout=BOUND, env=ENV)
    assert cap.returncode == 0, cap.stderr
    rep = subprocess.run([DCPTOOL, "replay", str(out), "--table", "documents", "--format", "jsonl"],
                         capture_output=True, text=True, timeout=BOUND)
    assert rep.returncode == 0, rep.stderr
    rows = [json.loads(x) for x in rep.stdout.splitlines() if x.strip()]
    return {r["key"]: r["cas"] for r in rows if r["state"] == "live"}


class LiveStream:
    """`dcptool stream --to forever` running while the SDK writes: each item line's
    (key -> op, cas), and `until(truth)` waits (bounded) for the last change of every key."""

    def __init__(self, addr: str):
        self.proc = subprocess.Popen([DCPTOOL, "stream", f"couchbase://{addr}/default", "--user", USER,
                                      "--to", "forever", "--format", "jsonl"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=ENV)
        self.last: dict[str, tuple[str, int]] = {}
        self.want: dict[str, tuple[str, int]] | None = None
        self.done = threading.Event()
        self.cond = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            r = json.loads(line)
            if r["op"] in ("mutation", "deletion", "expiration"):
                with self.cond:
                    self.last[r["key"]] = ("live" if r["op"] == "mutation" else "gone", r["cas"])
                    self._check()

    def _check(self) -> None:
        if self.want is not None and all(self.last.get(k, ("gone", 0))[0] == op and
                                         (op == "gone" or self.last[k][1] == cas)
                                         for k, (op, cas) in self.want.items()):
            self.done.set()

    def until(self, truth: dict, keys) -> bool:
        with self.cond:
            self.want = {k: ("live", truth[k]) if k in truth else ("gone", 0) for k in keys}
            self._check()
        ok = self.done.wait(BOUND / 2)
        self.proc.terminate()
        self.proc.wait(BOUND)
        return ok


@pytest.mark.parametrize("nodes,replicas", [(1, 0), (3, 1), (3, 0)])
def test_sdk_writes_equal_the_replayed_capture(serve, tmp_path, nodes, replicas):
    addr = serve("--nodes", str(nodes), "--replicas", str(replicas), "--seed", "7")
    live = LiveStream(addr)                  # open while the SDK writes
    cluster, coll = connect(addr)
    try:
        counts, truth = workload(coll, seed=25 + nodes + replicas, durable_ok=replicas > 0)
    finally:
        cluster.close()
    assert live.until(truth, KEYS), f"the live stream missed changes: {live.want} vs {live.last}"
    # the mix did what it was meant to (each kind of outcome at least once)
    wanted = {"upsert", "insert", "insert-exists", "replace", "replace-stale", "remove", "touch",
              "durable" if replicas else "durable-impossible"}
    assert wanted <= set(counts), counts
    assert counts["live"] > 5
    assert replayed_documents(addr, tmp_path) == truth


def test_sdk_follows_a_rebalance_and_a_hard_failover_without_losing_durable_writes(serve, tmp_path):
    """Writes before a rebalance and a hard failover of node 2 (the capture's frames drive
    both): every acknowledged durable write survives, each vbucket loses at most
    --failover-loss plain ones, the SDK's later writes reach the new owners, and the
    replayed capture equals what the SDK reads back."""
    from dcptool.protocol.dcp.server.bucket import vbucket_of
    loss = 5
    addr = serve("--nodes", "3", "--replicas", "1", "--seed", "3", "--items", "2000", "--rebalance-at", "500",
                 "--failover-at", "1500:2", "--failover-loss", str(loss))
    cluster, coll = connect(addr)
    majority = UpsertOptions(durability=ServerDurability(DurabilityLevel.MAJORITY))
    try:
        durable = {f"dur-{i:03d}": coll.upsert(f"dur-{i:03d}", {"i": i}, majority).cas for i in range(60)}
        plain = {f"plain-{i:03d}": coll.upsert(f"plain-{i:03d}", {"i": i}).cas for i in range(60)}
        first = replayed_documents(addr, tmp_path / "1")          # streams past both events
        rep = subprocess.run([DCPTOOL, "replay", str(tmp_path / "1" / "cap"), "--table", "topology",
                              "--format", "jsonl"], capture_output=True, text=True, timeout=BOUND)
        assert {json.loads(x)["rev"] for x in rep.stdout.splitlines()} >= {1, 2, 3}, "the events did not fire"
        assert all(first.get(k) == cas for k, cas in durable.items())
        for key, cas in durable.items():
            assert coll.get(key).cas == cas
        lost: dict[int, int] = {}
        for key, cas in plain.items():
            try:
                kept = coll.get(key).cas == cas
            except cbe.DocumentNotFoundException:
                kept = False
            if not kept:
                vb = vbucket_of(key.encode(), 16)
                lost[vb] = lost.get(vb, 0) + 1
        assert lost and all(n <= loss for n in lost.values()), lost    # (node 2 had active vbuckets)
        after = {f"after-{i:03d}": coll.upsert(f"after-{i:03d}", {"i": i}).cas for i in range(60)}
        truth = {}
        for key in list(durable) + list(plain) + list(after):
            try:
                truth[key] = coll.get(key).cas
            except cbe.DocumentNotFoundException:
                pass
    finally:
        cluster.close()
    docs = replayed_documents(addr, tmp_path / "2")
    assert {k: v for k, v in docs.items() if not k.startswith("doc-")} == truth
