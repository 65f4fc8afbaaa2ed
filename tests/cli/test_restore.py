"""`dcptool restore` end to end (issue 37): the official SDK writes JSON and binary documents
into `serve dcp` (some with expiry, some removed, some replaced), `dcptool capture --to now`
records them in two runs (the second after more writes), and `restore --as-of T` (T between
the runs) into an empty `serve dcp --nodes 3`: what the SDK reads back from the target equals
what it read from the source at T (body, flags, CAS) and the target's documents carry the
captured expiry and revision. A second restore writes nothing; a restore SIGKILLed half way
and run again ends in the same bucket state; a rebalance during the restore loses nothing;
--dry-run; --collection-map to an unknown collection exits 2 before anything is written."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from datetime import datetime, timedelta, timezone

import pytest

pytest.importorskip("couchbase")

from couchbase import exceptions as cbe  # noqa: E402
from couchbase.options import GetOptions, UpsertOptions  # noqa: E402
from couchbase.transcoder import RawBinaryTranscoder  # noqa: E402

from dcptool.protocol.dcp.server import producer as P  # noqa: E402
from dcptool.protocol.dcp.server.cluster import Event  # noqa: E402
from tests.support.chaos_sdk import PASSWORD, USER, connect  # noqa: E402
from tests.support.paths import DCPTOOL  # noqa: E402
from tests.support.threaded_server import ThreadedServer  # noqa: E402

ENV = dict(os.environ, DCPTOOL_PASSWORD=PASSWORD)
VBS = 16
N = 240
BINARY = RawBinaryTranscoder()


def _key(i: int) -> str:
    return f"doc-{i:04d}"


def _write_phase(coll, phase: int) -> None:
    """Phase 0: every key written (a third binary, a fifth with a 1-hour expiry), some
    replaced, some removed. Phase 1: more replaces and removes, and new keys."""
    if phase == 0:
        for i in range(N):
            expiry = {"expiry": timedelta(hours=1)} if i % 5 == 0 else {}
            if i % 3 == 0:
                coll.upsert(_key(i), bytes([i % 256]) * (i % 40 + 1), UpsertOptions(transcoder=BINARY, **expiry))
            else:
                coll.upsert(_key(i), {"i": i, "v": "x" * (i % 50)}, UpsertOptions(**expiry))
        for i in range(0, N, 7):
            coll.upsert(_key(i), {"i": i, "replaced": True})
        for i in range(3, N, 11):
            coll.remove(_key(i))
        return
    for i in range(1, N, 13):
        coll.upsert(_key(i), {"i": i, "phase": 1})
    for i in range(2, N, 17):
        try:
            coll.remove(_key(i))
        except cbe.DocumentNotFoundException:
            pass
    for i in range(N, N + 20):
        coll.upsert(_key(i), {"new": i})


def _read_all(coll, keys) -> dict:
    """key -> (body: bytes, or JSON text for a JSON document; flags; cas), None when missing."""
    out = {}
    for k in keys:
        try:
            r = coll.get(k)
            out[k] = (json.dumps(r.content_as[dict], sort_keys=True), r.flags, r.cas)
        except cbe.DocumentNotFoundException:
            out[k] = None
        except cbe.ValueFormatException:      # a binary document
            r = coll.get(k, GetOptions(transcoder=BINARY))
            out[k] = (bytes(r.value), r.flags, r.cas)
    return out


def _docs_state(model) -> dict:
    """The bucket's documents as the server holds them: key -> (kind, rev, cas, flags, expiry, value)."""
    from dcptool.protocol.dcp.server.kv_store import store_of
    st = store_of(model.buckets["default"], model)
    out = {}
    for vb in range(VBS):
        for (cid, key), it in st.vb(vb).docs.items():
            out[(cid, key)] = (it.kind if it.kind in ("m", "c") else "d", it.rev, it.cas, it.flags,
                               it.expiry if it.kind in ("m", "c") else 0, it.value if it.kind in ("m", "c") else b"")
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The capture of the SDK's writes: (capture dir, T, the SDK's read-back at T, the source
    bucket's documents at T)."""
    tmp = tmp_path_factory.mktemp("restore")
    model = P.server_from_options(vbuckets=VBS, items=0, seed=3, users={USER: PASSWORD})
    caps = tmp / "caps"
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        cluster, coll = connect(srv.host, srv.port, kv_timeout=5.0)
        try:
            _write_phase(coll, 0)
            keys = [_key(i) for i in range(N + 20)]
            at_t = _read_all(coll, keys)
            state_t = _docs_state(model)
            _capture(url, caps)
            t = datetime.now(timezone.utc)
            time.sleep(0.05)       # the second run's frames are received after T (timestamps, not ordering)
            _write_phase(coll, 1)
            _capture(url, caps, "--resume")
        finally:
            cluster.close()
    return caps, t.isoformat().replace("+00:00", "Z"), at_t, state_t, keys


def _capture(url, out, *extra):
    res = subprocess.run([DCPTOOL, "capture", url, "-o", str(out), "--quiet", "--user", USER, "--to", "now", *extra],
                         capture_output=True, text=True, timeout=120, env=ENV)
    assert res.returncode == 0, res.stderr


def _restore(caps, url, *extra, timeout=120):
    return subprocess.run([DCPTOOL, "restore", str(caps), url, "--user", USER, "--json", *extra],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


def _target(**kw):
    return P.server_from_options(vbuckets=VBS, items=0, seed=5, nodes=3, replicas=1, users={USER: PASSWORD}, **kw)


def test_restore_as_of_into_a_cluster_then_again(source):
    caps, t, at_t, state_t, keys = source
    model = _target()
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = _restore(caps, url, "--as-of", t)
        assert res.returncode == 0, res.stderr
        summary = json.loads(res.stdout)
        assert summary["written"] == summary["documents"] == len(state_t) and summary["failed"] == 0
        assert summary["deleted"] == sum(1 for v in state_t.values() if v[0] == "d")
        cluster, coll = connect(srv.host, srv.port, kv_timeout=5.0)
        try:
            assert _read_all(coll, keys) == at_t            # body, flags and CAS as the SDK read at T
        finally:
            cluster.close()
        got = _docs_state(model)
        assert {k: v[1:5] for k, v in got.items()} == {k: v[1:5] for k, v in state_t.items()}   # rev, cas, flags, expiry
        assert {k: v[0] for k, v in got.items()} == {k: v[0] for k, v in state_t.items()}
        again = _restore(caps, url, "--as-of", t)
        assert again.returncode == 0, again.stderr
        second = json.loads(again.stdout)
        assert second["written"] == 0 and second["skipped_target_newer_or_equal"] == len(state_t)
        assert _docs_state(model) == got


def test_a_restore_killed_half_way_and_run_again_ends_in_the_same_state(source):
    caps, t, at_t, state_t, keys = source
    whole = _target()
    with ThreadedServer(whole) as srv:
        assert _restore(caps, f"couchbase://{srv.host}:{srv.port}/default").returncode == 0
        expected = _docs_state(whole)
    model = _target()
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        proc = subprocess.Popen([DCPTOOL, "restore", str(caps), url, "--user", USER, "--window", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
        deadline = time.monotonic() + 60
        while getattr(model, "kv_writes", 0) < len(expected) // 2 and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        partial = len(_docs_state(model))
        res = _restore(caps, url)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["written"] == len(expected) - partial or partial == len(expected)
        got = _docs_state(model)
    # the same documents with the same metadata (the seqnos they took differ: not compared)
    assert got == expected


def test_a_rebalance_during_the_restore_loses_nothing(source, tmp_path):
    caps, t, at_t, state_t, keys = source
    count = len(state_t)
    model = _target(events=(Event(count // 3, "rebalance"), Event(count * 2 // 3, "rebalance")))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        # a DCP stream of the target counts frames: the rebalances fire as the restored writes stream
        cap = subprocess.Popen([DCPTOOL, "capture", url, "-o", str(tmp_path / "tcap"), "--quiet", "--user", USER,
                                "--to", "forever"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)
        try:
            deadline = time.monotonic() + 30
            while not model.stream_frames and not _streams(srv):
                assert time.monotonic() < deadline and cap.poll() is None
                time.sleep(0.01)
            res = _restore(caps, url, "--as-of", t, "--window", "4")
        finally:
            cap.send_signal(signal.SIGTERM)
            cap.wait(30)
        assert res.returncode == 0, res.stderr
        summary = json.loads(res.stdout)
        assert summary["written"] + summary["skipped_target_newer_or_equal"] == count and summary["failed"] == 0
        assert summary["rerouted"] > 0         # writes met the moved vbuckets (NOT_MY_VBUCKET) and followed
        assert [c.kind for c in model.cluster.changes if c.kind == "rebalance"] == ["rebalance", "rebalance"]
        got = _docs_state(model)
    assert {k: v[:5] for k, v in got.items()} == {k: v[:5] for k, v in state_t.items()}


def _streams(srv) -> bool:
    """Some connection of the target has its DCP streams open (asked on the server's loop)."""
    async def ask():
        return sum(len(p.conn.streams) for p in srv.server.protocols if p.conn is not None) >= VBS
    return asyncio.run_coroutine_threadsafe(ask(), srv.loop).result(30)


def test_dry_run_prints_what_it_would_write(source):
    caps, t, at_t, state_t, keys = source
    res = subprocess.run([DCPTOOL, "restore", str(caps), "couchbase://127.0.0.1:1/default", "--dry-run",
                          "--as-of", t, "--keys", "doc-00[0-4]*"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    want = {k[1].decode() for k in state_t if k[1].decode()[:6] in ("doc-00",) and k[1].decode()[6] in "01234"}
    assert {r["key"] for r in rows} == want
    deleted = {k[1].decode() for k, v in state_t.items() if v[0] == "d"}
    assert {r["key"] for r in rows if r["op"] == "delete"} == want & deleted
    one = next(r for r in rows if r["op"] == "set")
    cid_key = (0, one["key"].encode())
    assert (one["rev_seqno"], one["cas"], one["flags"], one["expiry"]) == state_t[cid_key][1:5]


def test_an_unknown_target_collection_exits_2_before_writing(source):
    caps, *_ = source
    model = _target()
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = _restore(caps, url, "--collection-map", "_default._default=nope.nothing")
        assert res.returncode == 2, res.stderr
        assert "nope.nothing" in res.stderr and "Traceback" not in res.stderr
        assert _docs_state(model) == {} and getattr(model, "kv_writes", 0) == 0


def test_no_server_exits_3_and_a_wrong_password_4_each_with_one_line(source):
    from tests.support.cli_util import error_line
    from tests.support.ports import refused_port
    caps, *_ = source
    with refused_port() as port:
        res = _restore(caps, f"couchbase://127.0.0.1:{port}/default")
    assert res.returncode == 3 and "cannot connect" in error_line(res)
    model = _target()
    with ThreadedServer(model) as srv:
        res = subprocess.run([DCPTOOL, "restore", str(caps), f"couchbase://{srv.host}:{srv.port}/default",
                              "--user", USER], capture_output=True, text=True, timeout=120,
                             env=dict(ENV, DCPTOOL_PASSWORD="wrong"))
        assert res.returncode == 4 and "refused" in error_line(res)
        assert getattr(model, "kv_writes", 0) == 0
