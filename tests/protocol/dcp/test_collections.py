"""Collection filters (issue 13): the producer's manifest, STREAM_REQ filter values and
system events (sans-IO), and `stream` / `capture` / `replay` with --scope and --collection
against `serve dcp` with several scopes: exactly the filtered collections' documents, a
collection dropped mid-stream (system event, "filter empty"), unknown names, resume."""

from __future__ import annotations

import json
import os

import pytest

from dcptool.protocol.dcp.client import manifest as C
from dcptool.protocol.dcp.server import manifest as PC
from dcptool.protocol.dcp.server import producer as P
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire.constants import Status, StreamEndReason
from dcptool.replay.store.reader import find_captures, read_capture_table
from tests.support.cli_util import run
from tests.support.threaded_server import ThreadedServer

ITEM_OPS = ("mutation", "deletion", "expiration")


# --------------------------------------------------------------------------- sans-IO

def test_manifest_json_is_couchbase_shaped_and_parses_back():
    man = PC.Manifest(2, 2)
    doc = json.loads(man.to_json())
    assert doc["uid"] == "1"
    scopes = {s["name"]: s for s in doc["scopes"]}
    assert scopes["_default"]["uid"] == "0" and scopes["_default"]["collections"] == [{"name": "_default", "uid": "0"}]
    assert scopes["inventory"] == {"name": "inventory", "uid": "8",
                                   "collections": [{"name": "airline", "uid": "8"}, {"name": "route", "uid": "9"}]}
    assert [c["uid"] for c in scopes["tenants"]["collections"]] == ["a", "b"]
    parsed = C.parse_manifest(man.to_json())
    assert parsed.uid == 1 and parsed.scopes["tenants"] == (9, {"airline": 10, "route": 11})


def test_resolve_names_to_a_filter_and_list_what_exists_for_unknown_names():
    man = C.parse_manifest(PC.Manifest(2, 2).to_json())
    assert C.resolve(man, scopes=("tenants",)) == {"scope": "9", "uid": "1"}
    assert C.resolve(man, collections=("tenants.route", "inventory.airline")) == {"collections": ["8", "b"], "uid": "1"}
    with pytest.raises(C.UnknownNames) as exc:
        C.resolve(man, scopes=("nope",), collections=("inventory.hotel", "inventory.route"))
    assert exc.value.missing == ["inventory.hotel", "nope"]
    assert "inventory.airline" in str(exc.value) and "tenants.route" in str(exc.value)


@pytest.mark.parametrize("value, status", [
    (b'{"collections":["8","9"]}', Status.SUCCESS),
    (b'{"scope":"9","uid":"1"}', Status.SUCCESS),
    (b'{"collections":["8"],"scope":"8"}', Status.EINVAL),      # both: invalid, as kv_engine
    (b'{"collections":"8"}', Status.EINVAL),
    (b'{"scope":8}', Status.EINVAL),
    (b'{"uid":1}', Status.EINVAL),
    (b'not json', Status.EINVAL),
    (b'{"collections":["8","7f"]}', Status.UNKNOWN_COLLECTION),
    (b'{"scope":"1f"}', Status.UNKNOWN_SCOPE),
])
def test_stream_request_filter_values(value, status):
    man = PC.Manifest(2, 2)
    got, flt, body = PC.parse_filter(value, man, collections=True)
    assert got == status
    if status in (Status.UNKNOWN_COLLECTION, Status.UNKNOWN_SCOPE):
        assert json.loads(body) == {"manifest_uid": "1"}
    assert (flt is not None) == (status == Status.SUCCESS)


def test_a_filter_without_collections_is_invalid_and_no_filter_passes_default_only():
    man = PC.Manifest(1, 2)
    assert PC.parse_filter(b'{"scope":"8"}', man, collections=False)[0] == Status.EINVAL
    status, flt, _ = PC.parse_filter(b"", man, collections=False)
    assert status == Status.SUCCESS and flt.allowed_ids(man) == {0}
    # a bucket of _default alone needs no filter at all (the pre-encoded fast path)
    assert PC.parse_filter(b"", PC.Manifest(), collections=True) == (Status.SUCCESS, None, b"")


def test_system_event_frames_decode_to_their_fields():
    bucket = P.Bucket(num_vbuckets=2, items=10, manifest=PC.Manifest(1, 2, PC.parse_events(
        ["1:inventory.hotel"], ["2:inventory.route"])))
    man = bucket.manifest
    assert man.fire_due(5, bucket) == 2 and man.uid == 3
    events = [it for it in bucket.vbuckets[0].mem]
    assert [it.kind for it in events] == ["sc", "sd"]
    frames = [PC.system_event_frame(0, 7, it) for it in events]
    msgs = [m.decode_bytes(f, True) for f in frames]
    got = [C.decode_system_event(x.event_id, x.version, x.key, x.value) for x in msgs]
    assert got[0] == {"event": "collection_create", "name": "hotel", "manifest_uid": 2, "scope_id": 8,
                      "collection_id": 10}
    assert got[1] == {"event": "collection_drop", "name": None, "manifest_uid": 3, "scope_id": 8,
                      "collection_id": 9}
    assert m.to_row(msgs[1])["collection_id"] == 9
    # the columnar decoder (stream, capture) agrees with the message decoder
    import numpy as np

    from dcptool.protocol.dcp.wire import columnar
    buf = b"".join(frames)
    offs = np.array([0, len(frames[0])], np.int64)
    batch = columnar.decode_batch(buf, offs, np.array([len(f) for f in frames], np.int64), collections=True)
    cid, valid = batch.numeric["collection_id"]
    assert valid.all() and cid.tolist() == [10, 9]
    assert batch.numeric["system_event_id"][0].tolist() == [0, 1]


def test_consumer_asks_the_manifest_once_and_every_stream_request_carries_the_filter():
    from dcptool.protocol.dcp.client import consumer as dcp_consumer
    from dcptool.protocol.dcp.client.consumer_api import FilterResolved, FilterUnknown
    from tests.support.dcp_pair import Pair, cfg
    srv = model_with(items=300, vbuckets=4)
    pair = Pair(srv, cfg(collections=True, vbuckets=[0, 1, 2, 3], collection_names=("tenants.route",)),
                byte_at_a_time=True).run()
    ops = [m.decode_bytes(f).op_code for f in pair.outbound]
    assert ops[:4] == [0x1F, 0x89, 0xBA, 0x50]      # HELLO, SELECT_BUCKET, the manifest, DCP_OPEN
    reqs = [m.decode_bytes(f) for f in pair.outbound if f[1] == 0x53]
    assert len(reqs) == 4 and {r.value for r in reqs} == {b'{"collections":["b"],"uid":"1"}'}
    assert pair.of(FilterResolved)[0].filter == {"collections": ["b"], "uid": "1"}
    assert pair.cons.finished and pair.of(dcp_consumer.Finished) == [dcp_consumer.Finished(4, 0)]
    keys = {k for items in pair.data(collections=True).values() for _, k in items}
    assert keys == {k for _, cid, k in want_docs(srv, {11})}
    # an unknown name: the event, and the handshake goes no further (no DCP_OPEN)
    pair = Pair(model_with(items=10, vbuckets=2), cfg(collections=True, scopes=("nope",))).run()
    assert [e.message.split(":")[0] for e in pair.of(FilterUnknown)] == ["unknown name nope"]
    assert 0x50 not in [m.decode_bytes(f).op_code for f in pair.outbound]


# --------------------------------------------------------------------------- end to end

def model_with(events=(), items=2000, vbuckets=8):
    man = PC.Manifest(2, 2, PC.parse_events(*events) if events else ())
    return P.server_from_options(vbuckets=vbuckets, items=items, seed=5, manifest=man)


def want_docs(model, cids) -> set:
    """(vbucket, collection id, key) of the producer's documents in those collections."""
    return {(vb.vbid, it.cid, it.key) for vb in model.buckets["default"].vbuckets
            for it in vb.items() if it.kind == "m" and it.cid in cids}


def stream_rows(url, *args):
    res = run("stream", url, "--format", "jsonl", *args)
    return res, [json.loads(line) for line in res.stdout.splitlines()]


def got_docs(rows) -> set:
    return {(r["vbucket"], r["collection_id"], r["key"].encode()) for r in rows
            if r["direction"] == "in" and r["op"] in ITEM_OPS}


@pytest.mark.integration
def test_scope_and_two_collection_filters_give_exactly_those_documents():
    model = model_with()
    man = model.buckets["default"].manifest
    tenants = {c.cid for c in man.collections.values() if c.sid == man.scope_id("tenants")}
    pair = {man.find("inventory", "route").cid, man.find("tenants", "airline").cid}
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res, rows = stream_rows(url, "--scope", "tenants")
        assert res.returncode == 0, res.stderr
        assert got_docs(rows) == want_docs(model, tenants) and len(tenants) == 2
        reqs = [r for r in rows if r["op"] == "stream_req" and r["direction"] == "out"]
        assert reqs and all(r["value_len"] == len(b'{"scope":"9","uid":"1"}') for r in reqs)
        res, rows = stream_rows(url, "--collection", "inventory.route", "--collection", "tenants.airline")
        assert res.returncode == 0, res.stderr
        assert got_docs(rows) == want_docs(model, pair)
        # no filter, with collections: every collection
        res, rows = stream_rows(url, "--collections")
        assert got_docs(rows) == want_docs(model, set(man.start_ids))
        # no collections at all: the default collection only, as a legacy client sees it
        res, rows = stream_rows(url)
        assert {(vb, k) for vb, _, k in got_docs(rows)} == {(vb, k) for vb, _, k in want_docs(model, {0})}


@pytest.mark.integration
def test_unknown_names_exit_2_listing_the_names_that_exist():
    with ThreadedServer(model_with(items=100)) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("stream", url, "--format", "jsonl", "--collection", "inventory.nope", "--scope", "ghosts")
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert "inventory.nope" in line and "ghosts" in line
    for name in ("inventory.airline", "inventory.route", "tenants.airline", "_default._default"):
        assert name in line
    assert "Traceback" not in res.stderr


@pytest.mark.integration
def test_a_collection_dropped_mid_stream_ends_its_only_filter_with_filter_empty(tmp_path):
    model = model_with(events=([], ["60:inventory.route"]))
    route = model.buckets["default"].manifest.find("inventory", "route").cid
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("capture", url, "-o", str(tmp_path / "c"), "--quiet", "--json", "--to", "forever",
                  "--collection", "inventory.route", "--duration", "60s")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stopped"] == "end"    # every stream ended: nobody waited for the duration
    t = read_capture_table(find_captures([str(tmp_path / "c")]))
    rows = [r for r in t.select(["direction", "op", "vbucket", "collection_id", "system_event_id",
                                 "stream_end_reason", "by_seqno"]).to_pylist() if r["direction"] == "in"]
    drops = [r for r in rows if r["op"] == "system_event"]
    assert sorted(r["vbucket"] for r in drops) == list(range(8))
    assert all(r["system_event_id"] == 1 and r["collection_id"] == route for r in drops)
    ends = {r["vbucket"]: r["stream_end_reason"] for r in rows if r["op"] == "stream_end"}
    assert ends == dict.fromkeys(range(8), int(StreamEndReason.FILTER_EMPTY))
    items = [r for r in rows if r["op"] in ITEM_OPS]
    assert items and all(r["collection_id"] == route for r in items)
    for vb in range(8):   # the drop comes after every item sent of that vbucket, the end after the drop
        seq = [r["op"] for r in rows if r["vbucket"] == vb and r["op"] in (*ITEM_OPS, "system_event", "stream_end")]
        assert seq[-2:] == ["system_event", "stream_end"]
    # the options record the filter and the manifest uid it was resolved with
    opts = json.loads(find_captures([str(tmp_path / "c")])[0].metadata["dcptool.options"])
    assert opts["collection_filter"] == {"collections": [f"{route:x}"], "uid": "1"}
    assert opts["collection_names"] == ["inventory.route"]


@pytest.mark.integration
def test_two_collections_one_dropped_keeps_streaming_the_other():
    model = model_with(events=(["70:tenants.hotel"], ["60:inventory.route"]))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res, rows = stream_rows(url, "--collection", "inventory.route", "--collection", "inventory.airline",
                                "--to", "forever", "--duration", "3s")
    assert res.returncode == 0, res.stderr
    ins = [r for r in rows if r["direction"] == "in"]
    # only the stop at --duration closed them (reason 1): airline is still there
    assert {r["stream_end_reason"] for r in ins if r["op"] == "stream_end"} <= {int(StreamEndReason.CLOSED)}
    events = [r for r in ins if r["op"] == "system_event"]
    # the drop of route reaches every vbucket; the create in tenants is not in this filter
    assert len(events) == 8 and {r["collection_id"] for r in events} == {9}
    # and is told once on stderr, by name, with the manifest uid it moved to
    told = [line for line in res.stderr.splitlines() if line.startswith("collection drop")]
    assert told == ["collection drop inventory.route (collection 0x9) manifest uid 0x2"]


@pytest.mark.integration
def test_resume_keeps_the_filter_and_uid_and_replay_gives_the_documents(tmp_path):
    model = model_with()
    man = model.buckets["default"].manifest
    tenants = {c.cid for c in man.collections.values() if c.sid == man.scope_id("tenants")}
    out = str(tmp_path / "c")
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        first = run("capture", url, "-o", out, "--quiet", "--json", "--scope", "tenants", "--max-messages", "300")
        assert first.returncode == 0, first.stderr
        other = run("capture", url, "-o", out, "--quiet", "--json", "--resume", "--scope", "inventory")
        assert other.returncode == 2 and "--scope tenants" in other.stderr
        again = run("capture", url, "-o", out, "--quiet", "--json", "--resume")
        assert again.returncode == 0, again.stderr
    files = find_captures([out])
    ids = {f.capture_id for f in files}
    assert len(ids) == 2
    for f in files:
        opts = json.loads(f.metadata["dcptool.options"])
        assert opts["collection_filter"] == {"scope": "9", "uid": "1"}
        assert opts["scopes"] == ["tenants"]
    t = read_capture_table(files)
    rows = [r for r in t.select(["direction", "op", "vbucket", "collection_id", "key"]).to_pylist()
            if r["direction"] == "in" and r["op"] in ITEM_OPS]
    assert {(r["vbucket"], r["collection_id"], r["key"]) for r in rows} == want_docs(model, tenants)
    res = run("replay", out, "--table", "documents", "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    docs = [json.loads(line) for line in res.stdout.splitlines()]
    assert {(d["vbucket"], d["collection_id"], d["key"].encode()) for d in docs} == want_docs(model, tenants)


@pytest.fixture(scope="module")
def dropped_capture(tmp_path_factory):
    """A capture of inventory.airline + inventory.route where route is dropped mid-stream."""
    model = model_with(events=([], ["60:inventory.route"]))
    out = str(tmp_path_factory.mktemp("dropped") / "c")
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("capture", url, "-o", out, "--quiet", "--json", "--collection", "inventory.airline",
                  "--collection", "inventory.route", "--to", "forever", "--duration", "3s")
    assert res.returncode == 0, res.stderr
    return model, find_captures([out])


@pytest.mark.integration
def test_replay_leaves_a_dropped_collections_documents_out(dropped_capture):
    from dcptool.replay.local import engine as local
    model, files = dropped_capture
    man = model.buckets["default"].manifest
    airline, route = man.find("inventory", "airline").cid, man.collections[9].cid
    assert man.collections[route].dropped
    t = read_capture_table(files, ["direction", "op", "collection_id"]).to_pylist()
    assert any(r["op"] == "mutation" and r["collection_id"] == route for r in t)   # route's items were received
    res = local.replay_local(files)
    docs = res.table("documents")
    got = {(r["vbucket"], r["collection_id"], r["key"]) for r in docs.select(["vbucket", "collection_id", "key"]).to_pylist()}
    assert got == want_docs(model, {airline})
    # filtered snapshots end with a seqno advanced where their last seqno is not ours: no findings
    check = run("verify", os.path.dirname(files[0].path), "--format", "jsonl")
    assert check.returncode == 0, check.stdout + check.stderr
    live = {r["vbucket"]: r["live"] for r in res.table("vbuckets").to_pylist()}
    per_vb = {}
    for vb, _, _ in got:
        per_vb[vb] = per_vb.get(vb, 0) + 1
    assert live == per_vb


@pytest.mark.spark
@pytest.mark.integration
def test_spark_agrees_on_the_dropped_collection(dropped_capture, spark):
    from dcptool.replay.local import engine as local
    from dcptool.replay.rules import tables as T
    from dcptool.replay.spark import engine as spark_engine
    _, files = dropped_capture
    ref = local.replay_local(files)
    got = spark_engine.replay_spark(spark, files)
    for name in ("documents", "vbuckets"):
        assert T.checksum(name, got.table(name)) == T.checksum(name, ref.table(name)), name
