"""`dcptool trace`: the story and verdict of one key, checked against the built-in producer's
own truth (its model's final bucket: each key's latest item, and the keys whose changes a
failover lost) in captures with a failover, a rebalance, a SIGKILL then --resume, a dropped
collection, and for a key never seen."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys

import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.bucket import vbucket_of
from dcptool.protocol.dcp.server.cluster import Event
from dcptool.replay.check import trace as T
from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.cli_util import run
from tests.support.live_capture import data_on_disk
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration
DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
STATE = {"m": "live", "d": "deleted", "x": "expired"}
CHANGES = ("mutation", "deletion", "expiration")


def _latest(model) -> dict[bytes, tuple[int, object]]:
    """key -> (vbucket, its latest item) in the producer's final bucket."""
    return {k: (vb.vbid, it) for vb in model.buckets["default"].vbuckets for k, it in vb.latest().items()}


def _by_key(rows) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for r in rows:
        out.setdefault(r["key"], []).append(r)
    return out


def _received(files, keys) -> dict[bytes, int]:
    """Changes of each key in the frames, counted independently of trace."""
    t = read_capture_table(files, ["direction", "op", "key"]).to_pylist()
    out: dict[bytes, int] = {}
    for r in t:
        if r["direction"] == "in" and r["op"] in CHANGES and r["key"] in keys:
            out[r["key"]] = out.get(r["key"], 0) + 1
    return out


def _check_against_model(model, files, keys: list[bytes]) -> dict[str, list[dict]]:
    """Every key's verdict is the producer's final state of it, at its latest seqno, and the
    trace holds one change row per change received."""
    latest = _latest(model)
    rows = _by_key(T.trace([os.path.dirname(files[0].path)], keys))
    counts = _received(files, set(keys))
    for k in keys:
        story = rows[k.decode()]
        verdict = story[-1]
        vb, it = latest[k]
        assert verdict["event"] == "verdict" and verdict["verdict"] == STATE[it.kind], (k, verdict)
        assert verdict["vbucket"] == vb and verdict["seqno"] == it.seqno, (k, verdict, it.seqno)
        assert verdict["explain"].startswith(repr(k.decode()))
        assert sum(r["event"] == "change" for r in story) == counts[k]
        assert [r["event"] for r in story].count("verdict") == 1
    return rows


def test_failover_trace_tells_the_rollback_and_the_restoring_change(failover_capture):
    model, files = failover_capture
    undone = local.replay_local(files).table("undone").to_pylist()
    assert undone
    lost = {u["key"]: u for u in undone}
    rng = random.Random(27)
    others = rng.sample(sorted(k for k in _latest(model) if k not in lost), 10)
    keys = sorted(lost)[:40] + others
    rows = _check_against_model(model, files, keys)
    for k in keys:
        story = rows[k.decode()]
        rbs = [r for r in story if r["event"] == "rollback"]
        if k not in lost:
            assert rbs == [] and story[-1]["restored"] is None
            continue
        u = lost[k]
        # the producer rewrote every key it lost on its new branch: restored at its latest seqno
        assert rbs and all(r["restored"] for r in rbs), story
        assert rbs[0]["rollback_seqno"] == u["rollback_seqno"] and rbs[0]["frame_no"] == u["frame_no"]
        assert rbs[-1]["restored_seqno"] == _latest(model)[k][1].seqno
        changes = [r for r in story if r["event"] == "change"]
        # the undone change came before the rollback, the restoring one after it
        assert changes[0]["frame_no"] < rbs[0]["frame_no"] < changes[-1]["frame_no"]
        assert "was undone by the rollback of vbucket" in story[-1]["explain"]
        assert story[-1]["explain"].endswith("and restored by this one")
        assert all(r["snapshot_kind"] in ("disk", "memory") for r in changes)


def test_a_key_never_seen_tells_its_vbucket_and_how_far_it_was_streamed(failover_capture):
    model, files = failover_capture
    key = b"no-such-document"
    [v] = T.trace([os.path.dirname(files[0].path)], [key])
    assert v["verdict"] == "not_seen" and v["vbucket"] == vbucket_of(key, 16)
    high = model.buckets["default"].vbuckets[v["vbucket"]].high_seqno
    assert f"its vbucket {v['vbucket']} was streamed" in v["explain"] and f"to seqno {high}" in v["explain"]
    # a vbucket the capture never asked for is told as such
    [v] = T.trace([os.path.dirname(files[0].path)], [key], vbucket=40)
    assert v["verdict"] == "not_seen" and "vbucket 40 was never streamed" in v["explain"]


def test_cli_prints_jsonl_and_exits_0(failover_capture):
    _, files = failover_capture
    caps = os.path.dirname(files[0].path)
    res = run("trace", caps, "doc-00000001", "never-there", "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert [x["verdict"] for x in lines if x["event"] == "verdict"] == ["live", "not_seen"]
    bad = run("trace", caps, "k", "--collection", "nope.nope")
    assert bad.returncode == 2 and "not known" in bad.stderr and "Traceback" not in bad.stderr
    bad = run("trace", "/nonexistent-capture", "k")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_rebalance_and_failover_on_a_cluster(tmp_path):
    # paced so that every node is still streaming when node 1 fails (see test_cluster_capture.py)
    model = P.server_from_options(vbuckets=16, items=3000, seed=5, nodes=3, replicas=1,
                                  events=(Event(800, "rebalance"), Event(1800, "failover", 1)),
                                  scenarios=P.Scenarios(failover_loss=12, slow=0.01, slow_frames=16))
    with ThreadedServer(model) as srv:
        res = subprocess.run([DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default", "-o",
                              str(tmp_path), "--quiet", "--timeout", "5s"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    files = find_captures([str(tmp_path)])
    undone = local.replay_local(files).table("undone").to_pylist()
    lost = sorted({u["key"] for u in undone})
    moved = [k for k in sorted(_latest(model))[::50]]
    rows = _check_against_model(model, files, lost[:20] + moved)
    events = {r["event"] for story in rows.values() for r in story}
    # the vbuckets moved: the map change and the streams reopened on other nodes are in the stories
    assert "topology" in events and ("reroute" in events or "stream_resume" in events), events
    assert lost
    for k in lost[:20]:
        story = rows[k.decode()]
        assert any(r["event"] == "rollback" and r["restored"] for r in story), story
        # the failover moved the vbucket: the sentence names the move before the rollback
        assert "after its active node moved from" in story[-1]["explain"], story[-1]["explain"]


def test_sigkill_then_resume_reads_the_in_progress_segment(tmp_path):
    model = P.server_from_options(vbuckets=8, items=3000, seed=11, checkpoint_items=50)
    out = tmp_path / "caps"
    with ThreadedServer(model, rate=2000) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        p = subprocess.Popen([DCPTOOL, "capture", url, "-o", str(out), "--to", "forever", "--quiet"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        data_on_disk(out, proc=p, timeout=60)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        killed = find_captures([str(out)])
        assert any(f.in_progress for f in killed)
        # trace reads the .arrows of the killed run
        seen = read_capture_table(killed, ["direction", "op", "key"]).to_pylist()
        # a key whose last change in the killed capture is a mutation (the server's workload
        # deletes keys too: the first key mutated may be deleted later in the capture)
        last = {r["key"]: r["op"] for r in seen
                if r["direction"] == "in" and r["op"] in ("mutation", "deletion", "expiration")}
        key = next(k for k, op in last.items() if op == "mutation")
        story = T.trace([str(out)], [key])
        assert story[-1]["verdict"] == "live" and any(r["event"] == "change" for r in story)
        srv.loop.call_soon_threadsafe(srv.server._rate_task.cancel)   # the bucket stops changing
        res = subprocess.run([DCPTOOL, "capture", url, "-o", str(out), "--resume", "--to", "now", "--quiet"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
    files = find_captures([str(out)])
    assert len({f.capture_id for f in files}) == 2 and not any(f.in_progress for f in files)
    keys = sorted(_latest(model))[::200] + [key]
    rows = _check_against_model(model, files, keys)
    # the resumed run's stream requests are in the story after the key's first change
    assert any(r["event"] == "stream_resume" and r["capture_id"] != rows[key.decode()][0]["capture_id"]
               for story in rows.values() for r in story)


def test_a_dropped_collection_deletes_its_keys_and_a_filtered_one_is_not_seen(tmp_path):
    from dcptool.protocol.dcp.server import manifest as PC
    man = PC.Manifest(2, 2, PC.parse_events([], ["60:inventory.route"]))
    model = P.server_from_options(vbuckets=8, items=1000, seed=5, manifest=man)
    m = model.buckets["default"].manifest
    airline, route = m.find("inventory", "airline").cid, m.find("inventory", "route").cid
    out = str(tmp_path / "c")
    with ThreadedServer(model) as srv:
        res = run("capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", out, "--quiet",
                  "--collection", "inventory.airline", "--collection", "inventory.route",
                  "--to", "forever", "--duration", "3s")
    assert res.returncode == 0, res.stderr
    files = find_captures([out])
    got = read_capture_table(files, ["direction", "op", "collection_id", "key"]).to_pylist()
    route_keys = sorted({r["key"] for r in got if r["op"] == "mutation" and r["collection_id"] == route})
    airline_keys = sorted({r["key"] for r in got if r["op"] == "mutation" and r["collection_id"] == airline})
    assert route_keys and airline_keys
    for name in ("inventory.route", f"0x{route:x}"):
        story = T.trace([out], [route_keys[0]], collection=name)
        events = [r["event"] for r in story]
        # the drop after its change, then the stream's end (filter empty), then the verdict
        assert events.index("change") < events.index("collection_drop") < events.index("stream_end"), events
        assert events[-1] == "verdict"
        assert story[-1]["verdict"] == "deleted" and "was dropped" in story[-1]["explain"]
    story = T.trace([out], [airline_keys[0]], collection="inventory.airline")
    assert story[-1]["verdict"] == "live" and "collection_drop" not in [r["event"] for r in story]
    # a key of a collection the capture did not stream: filtered out
    other = next(it.key for vb in model.buckets["default"].vbuckets for it in vb.items()
                 if it.kind == "m" and it.cid not in (airline, route, 0))
    other_cid = next(it.cid for vb in model.buckets["default"].vbuckets for it in vb.items() if it.key == other)
    [v] = T.trace([out], [other], collection=f"0x{other_cid:x}")
    assert v["verdict"] == "not_seen" and "filtered out" in v["explain"]


@pytest.mark.parametrize("seed", range(6))
def test_verdicts_agree_with_replay_on_generated_captures(tmp_path, seed):
    """Generated captures (tests/support/capgen.py: rollbacks that nothing restores, history
    snapshots, reconnects, several captures, an in-progress last segment): every document's
    verdict is replay's `documents` state at its seqno, and a document only in `undone` is
    `undone`."""
    from tests.support import capgen
    capgen.write_captures(capgen.generate("dcp", seed, n_events=300), str(tmp_path), seed=seed,
                          in_progress_last=seed % 2 == 1)
    rep = local.replay_local(find_captures([str(tmp_path)]))
    docs = {(d["vbucket"], d["collection_id"], d["key"]): d for d in rep.table("documents").to_pylist()}
    undone = {(u["vbucket"], u["collection_id"], u["key"]) for u in rep.table("undone").to_pylist()}
    keys = sorted({k for _, _, k in docs} | {k for _, _, k in undone})
    verdicts = [r for r in T.trace([str(tmp_path)], keys) if r["event"] == "verdict"]
    got = {(v["vbucket"], v["collection_id"], v["key"].encode()): v for v in verdicts}
    assert set(got) == set(docs) | undone
    for doc, v in got.items():
        if doc in docs:
            assert (v["verdict"], v["seqno"]) == (docs[doc]["state"], docs[doc]["by_seqno"]), (doc, v)
        else:
            assert v["verdict"] == "undone" and "not restored" in v["explain"], (doc, v)
    if undone - set(docs):
        assert any(v["verdict"] == "undone" for v in verdicts)
