"""Change history (issue 13) end to end against the built-in producer: collections that keep
history (`serve dcp --history-collections`), `--change-streams` (every version of a key in
History|MayContainDuplicates snapshots, flags shown by name; de-duplicated without it; refused
on a bucket without history), and replay's `history` table (every change not undone, the last
one equal to `documents`, the same checksums on both engines)."""

from __future__ import annotations

import json
from collections import Counter

import pyarrow.parquet as pq
import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.server.history import enable_history, memory_snapshot
from dcptool.protocol.dcp.server.manifest import Manifest
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from tests.support.cli_util import capture_files as capture
from tests.support.cli_util import error_line, run, stream_rows
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration
DOC_COLS = ["vbucket", "collection_id", "key", "by_seqno", "rev_seqno", "cas", "state", "datatype",
            "item_flags", "expiration", "value_len"]
CHANGES = ("mutation", "deletion", "expiration")


def model_with_history(seed: int, history=("all",), *, scopes: int = 0, live: int = 400, sync_ratio: float = 0.0):
    """4 vbuckets, 200 documents on disk, then `live` seeded changes that update the same
    keys again and again (checkpoints of 20 seqnos: several versions of a key per snapshot)."""
    manifest = Manifest(scopes, 2)
    if history:
        enable_history(manifest, history)
    model = P.server_from_options(vbuckets=4, items=200, seed=seed, checkpoint_items=20, manifest=manifest)
    b = model.buckets["default"]
    b.sync_ratio = sync_ratio
    b.mutate_random(live)
    return model


def versions(model, cids=None) -> int:
    """Every change the producer made that a consumer without sync writes sees (mutations,
    deletions, expirations; a committed durable write as its commit)."""
    return sum(1 for vb in model.buckets["default"].vbuckets for it in vb.items()
               if it.kind in ("m", "d", "x", "c") and (cids is None or it.cid in cids))


def items_in(rows) -> list[dict]:
    return [r for r in rows if r["direction"] == "in" and r["op"] in CHANGES]


def per_snapshot(rows) -> list[tuple[str, list[dict]]]:
    """(marker flag names, its items) per snapshot, per vbucket in frame order."""
    out, open_ = [], {}
    for r in rows:
        if r["direction"] != "in":
            continue
        if r["op"] == "snapshot_marker":
            open_[r["vbucket"]] = (r["snap_flag_names"], [])
            out.append(open_[r["vbucket"]])
        elif r["op"] in CHANGES:
            open_[r["vbucket"]][1].append(r)
    return out


# --------------------------------------------------------------------------- producer

def test_manifest_says_which_collections_keep_history_and_names_are_checked():
    m = Manifest(1, 2)
    enable_history(m, ["inventory.route"])
    doc = json.loads(m.to_json())
    hist = {(s["name"], c["name"]): c.get("history", False) for s in doc["scopes"] for c in s["collections"]}
    assert hist == {("_default", "_default"): False, ("inventory", "airline"): False, ("inventory", "route"): True}
    with pytest.raises(ValueError, match="inventory.airline"):
        enable_history(m, ["inventory.hotel"])
    res = run("serve", "dcp", "--port", "0", "--scopes", "1", "--history-collections", "inventory.hotel")
    assert res.returncode == 2 and "inventory.route" in res.stderr and "--history-collections" in res.stderr


def test_memory_snapshot_keeps_every_version_only_with_change_streams():
    model = model_with_history(5)
    b = model.buckets["default"]
    conn = model.connect(0.0)
    conn.bucket = b
    vb = b.vbuckets[0]
    snap = vb.mem[:20]
    assert len({it.key for it in snap}) < len(snap)          # the seeded traffic repeats keys
    deduped, _, flags = memory_snapshot(conn, snap)
    assert flags == 0 and len(deduped) == len({it.key for it in snap})
    conn.controls["change_streams"] = "true"
    every, mvs, flags = memory_snapshot(conn, snap)
    assert flags == 0x30 and every == snap and mvs == snap[-1].seqno


def test_change_streams_stream_every_version_with_history_flags_by_name():
    model = model_with_history(7)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        plain = stream_rows(url)
        hist = stream_rows(url, "--change-streams")
    assert len(items_in(hist)) == versions(model)
    assert len(items_in(plain)) < versions(model)
    assert {f for f, _ in per_snapshot(hist)} == {"disk|checkpoint|history|may_duplicates",
                                                  "memory|checkpoint|history|may_duplicates"}
    assert {f for f, _ in per_snapshot(plain)} == {"disk|checkpoint", "memory|checkpoint"}
    # without change_streams a snapshot never repeats a key; with it, some do
    assert all(len({r["key"] for r in its}) == len(its) for _, its in per_snapshot(plain))
    assert any(len({r["key"] for r in its}) < len(its) for _, its in per_snapshot(hist))
    # the flags are numbers too, as captured
    assert {r["snap_flags"] for r in hist if r["op"] == "snapshot_marker"} == {0x36, 0x35}
    assert any(r["op"] == "control" and r["key"] == "change_streams" and r["direction"] == "out" for r in hist)


def test_only_the_history_collection_keeps_every_version():
    model = model_with_history(11, ("inventory.airline",), scopes=1)
    airline = model.buckets["default"].manifest.find("inventory", "airline").cid
    with ThreadedServer(model) as srv:
        rows = stream_rows(f"couchbase://{srv.host}:{srv.port}/default", "--change-streams", "--collections")
    got = items_in(rows)
    assert sum(1 for r in got if r["collection_id"] == airline) == versions(model, {airline})
    others = [r for r in got if r["collection_id"] != airline]
    assert 0 < len(others) < versions(model) - versions(model, {airline})
    for flags, its in per_snapshot(rows):
        rest = [r["key"] for r in its if r["collection_id"] != airline]
        assert len(set(rest)) == len(rest)                    # de-duplicated among themselves
        if any(r["collection_id"] == airline for r in its):
            assert flags.endswith("|history|may_duplicates")


def test_change_streams_refused_without_history_exits_5_naming_it():
    model = model_with_history(2, history=())
    with ThreadedServer(model) as srv:
        res = run("stream", f"couchbase://{srv.host}:{srv.port}/default", "--change-streams")
    assert res.returncode == 5
    line = error_line(res)
    assert "change_streams" in line and "not_supported" in line


# --------------------------------------------------------------------------- capture + replay

@pytest.fixture(scope="module")
def history_captures(tmp_path_factory):
    """Captures of one producer with and without --change-streams, and with sync writes."""
    tmp = tmp_path_factory.mktemp("history")
    model = model_with_history(13, sync_ratio=0.3)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        out = {"hist": capture(url, tmp / "h", "--change-streams"), "plain": capture(url, tmp / "p"),
               "sync": capture(url, tmp / "s", "--change-streams", "--sync-writes")}
    model2 = model_with_history(17, scopes=1)     # two streams per vbucket: markers per stream id
    with ThreadedServer(model2) as srv:
        out["sids"] = capture(f"couchbase://{srv.host}:{srv.port}/default", tmp / "i", "--change-streams",
                              "--stream-ids", "--collection", "inventory.airline", "--collection", "inventory.route")
    return model, out


def _docs(t) -> list[dict]:
    return sorted(t.select(DOC_COLS).to_pylist(), key=lambda r: (r["vbucket"], r["key"]))


def test_capture_records_the_option_and_the_control(history_captures):
    _, caps = history_captures
    meta = pq.ParquetFile(caps["hist"][0].path).schema_arrow.metadata
    options = json.loads(meta[b"dcptool.options"])
    assert options["change_streams"] is True and options["dcp_controls"]["change_streams"] == "true"
    assert "change_streams" in options["required_controls"]


def test_history_has_every_version_and_documents_the_last(history_captures):
    model, caps = history_captures
    hist, plain = local.replay_local(caps["hist"]), local.replay_local(caps["plain"])
    assert _docs(hist.table("documents")) == _docs(plain.table("documents"))
    h = hist.table("history")
    assert h.num_rows == versions(model)
    assert plain.table("history").num_rows < versions(model)
    assert {f for f in h.column("snap_flags").to_pylist()} == {0x36, 0x35}
    # each document's last change in `history` is its row in `documents`
    last = {}
    for r in h.to_pylist():
        last[(r["vbucket"], r["collection_id"], r["key"])] = r
    assert _docs(hist.table("documents")) == sorted(
        ({c: r[c] for c in DOC_COLS} for r in last.values()), key=lambda r: (r["vbucket"], r["key"]))
    # every version of a key, in seqno order, as the producer wrote them
    want = Counter(it.key for vb in model.buckets["default"].vbuckets for it in vb.items() if it.kind in "mdxc")
    assert Counter(h.column("key").to_pylist()) == want


def test_commits_in_history_take_their_prepares_columns(history_captures):
    model, caps = history_captures
    rep = local.replay_local(caps["sync"])
    h = rep.table("history").to_pylist()
    assert len(h) == versions(model)
    commits = [r for r in h if r["op"] == "commit"]
    assert commits and all(r["state"] == "live" and r["value_len"] > 0 and r["cas"] for r in commits)
    docs = {(r["vbucket"], r["key"]): r for r in _docs(rep.table("documents"))}
    hit = [r for r in commits if docs[(r["vbucket"], r["key"])]["by_seqno"] == r["by_seqno"]]
    assert hit and all(docs[(r["vbucket"], r["key"])] == {c: r[c] for c in DOC_COLS} for r in hit)


def test_history_leaves_out_what_a_rollback_undid(failover_capture):
    _, files = failover_capture
    rep = local.replay_local(files)
    undone = rep.table("undone").to_pylist()
    assert undone
    frames = {(r["change_capture_id"], r["change_frame_no"]) for r in undone}
    h = rep.table("history").to_pylist()
    assert not frames & {(r["capture_id"], r["frame_no"]) for r in h}
    keys = {(r["vbucket"], r["collection_id"], r["key"], r["by_seqno"]) for r in h}
    assert len(keys) == len(h)
    docs = rep.table("documents").to_pylist()
    assert {(d["vbucket"], d["key"], d["by_seqno"]) for d in docs} <= {(k[0], k[2], k[3]) for k in keys}


@pytest.mark.spark
def test_spark_gives_the_same_history_and_documents(spark, history_captures, failover_capture):
    from dcptool.replay.spark import engine as spark_engine
    _, caps = history_captures
    # (documents of durable writes on both engines: test_dcp_options.py)
    sids = local.replay_local(caps["sids"]).table("history")
    assert sids.num_rows and sids.column("snap_flags").null_count == 0
    for files, names in ((caps["hist"], ("history", "documents")), (caps["sync"], ("history",)),
                         (caps["sids"], ("history",)), (failover_capture[1], ("history", "documents"))):
        want = local.replay_local(files)
        rep = spark_engine.replay_spark(spark, files)
        try:
            for name in names:
                assert T.checksum(name, rep.table(name)) == T.checksum(name, want.table(name)), name
        finally:
            rep.close()


# --------------------------------------------------------------------------- the rule, by hand

def _kept_rows(rows: list[dict]):
    """The rows HistoryState keeps, as a table (_seq = position: frame order)."""
    import pyarrow as pa

    from dcptool.replay.rules.history import HISTORY_COLUMNS
    from dcptool.replay.store.schema import capture_schema
    sch = capture_schema("dcp")
    cols = {c: pa.array([r.get(c) for r in rows], sch.field(c).type if c not in ("op", "capture_id") else pa.string())
            for c in HISTORY_COLUMNS}
    cols["_seq"] = pa.array(range(len(rows)), pa.int64())
    return pa.table(cols)


def test_history_rule_resend_stream_end_commit_and_key_order():
    from dcptool.replay.rules.history import history_table
    base = {"vbucket": 1, "collection_id": 8, "capture_id": "c", "ts": 0}

    def row(op, **kw):
        return dict(base, op=op, frame_no=len(rows), **kw)
    rows: list[dict] = []
    rows.append(row("snapshot_marker", snap_flags=0x35))
    rows.append(row("mutation", key=b"b", by_seqno=5, cas=1, value_len=3))
    rows.append(row("prepare", key=b"\xffz", by_seqno=6, cas=77, rev_seqno=4, value_len=9, datatype=1))
    rows.append(row("stream_end"))
    rows.append(row("commit", key=b"\xffz", by_seqno=7))                # under no marker: flags null
    rows.append(row("snapshot_marker", snap_flags=0x06))
    rows.append(row("mutation", key=b"b", by_seqno=5, cas=2, value_len=4))   # re-sent: the last wins
    rows.append(row("mutation", key=b"a", by_seqno=8, cas=3, value_len=1))
    got = history_table(_kept_rows(rows)).to_pylist()
    assert [(r["key"], r["by_seqno"], r["op"], r["state"]) for r in got] == [
        (b"a", 8, "mutation", "live"), (b"b", 5, "mutation", "live"), (b"\xffz", 7, "commit", "live")]
    a, b, z = got
    assert (b["cas"], b["value_len"], b["frame_no"], b["snap_flags"]) == (2, 4, 6, 0x06)
    assert (z["cas"], z["rev_seqno"], z["value_len"], z["datatype"], z["snap_flags"]) == (77, 4, 9, 1, None)
    assert a["snap_flags"] == 0x06
