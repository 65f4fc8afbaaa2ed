"""DCP stream options of issue 13 end to end against the built-in producer: --compress
(a compressed value round trip, and one that does not decompress), --sync-writes (prepare,
commit, abort: capture, then replay in both engines), --expiry-opcode/--no-expiry-opcode,
--ack-ratio, refused controls, and `stream --json`."""

from __future__ import annotations

import json
import struct

import pyarrow as pa
import pytest

from dcptool.protocol.dcp.server import producer as P
from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import read_capture_table
from tests.support.cli_util import capture_files as capture
from tests.support.cli_util import run, stream_rows
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration
DOC_COLS = ["vbucket", "key", "by_seqno", "rev_seqno", "cas", "state", "item_flags", "expiration"]


def model_with_live(seed: int, *, sync_ratio: float = 0.0, live: int = 300, scenarios=None):
    """A bucket of 4 vbuckets: 200 documents on disk, then `live` seeded live changes (a
    share of them durable writes)."""
    model = P.server_from_options(vbuckets=4, items=200, seed=seed, scenarios=scenarios, checkpoint_items=20)
    b = model.buckets["default"]
    b.sync_ratio = sync_ratio
    b.mutate_random(live)
    return model


def docs(files) -> list[dict]:
    t = local.replay_local(files).table("documents")
    return sorted(t.select(DOC_COLS).to_pylist(), key=lambda r: (r["vbucket"], r["key"]))


def ops_in(rows) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        if r["direction"] == "in":
            out[r["op"]] = out.get(r["op"], 0) + 1
    return out


# --------------------------------------------------------------------------- compression

def test_compressed_values_round_trip_and_a_corrupt_one_is_flagged(tmp_path):
    model = model_with_live(1, scenarios=P.Scenarios(corrupt_value_at=7))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        plain = stream_rows(url, "--values")
        packed = stream_rows(url, "--values", "--compress")
        files = capture(url, tmp_path / "c", "--compress")
        plain_files = capture(url, tmp_path / "p")
    want = {(r["vbucket"], r["by_seqno"]): r["value"] for r in plain if r["op"] == "mutation"}
    got = [r for r in packed if r["op"] == "mutation"]
    assert len(got) == len(want) > 200
    assert all(r["datatype"] & 0x02 for r in got)
    bad = [r for r in got if r["value_error"]]
    # the 7th compressed value the server sent (this stream's) does not decompress: flagged, not fatal
    assert len(bad) == 1 and bad[0]["value"] is None and bad[0]["value_base64"]
    assert all(r["value"] == want[(r["vbucket"], r["by_seqno"])] for r in got if not r["value_error"])
    assert any(r["op"] == "control" and r["key"] == "force_value_compression" for r in packed)
    # the capture keeps the compressed bytes as sent, and records the option
    t = read_capture_table(files)
    muts = t.filter(pa.compute.equal(t.column("op"), "mutation"))
    assert all(dt & 0x02 for dt in muts.column("datatype").to_pylist())
    assert json.loads(files[0].metadata["dcptool.options"])["compress"] is True
    # replay: the same documents as the plain capture (value_len is the length as sent)
    assert docs(files) == docs(plain_files)


# --------------------------------------------------------------------------- sync writes

def test_sync_writes_prepare_commit_abort_replay_as_committed_mutations(tmp_path):
    model = model_with_live(2, sync_ratio=0.5)
    kinds = [it.kind for vb in model.buckets["default"].vbuckets for it in vb.mem]
    assert kinds.count("p") == kinds.count("c") + kinds.count("a") and kinds.count("a") > 0
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        sync_rows = stream_rows(url, "--sync-writes")
        plain_rows = stream_rows(url)
        sync_files = capture(url, tmp_path / "s", "--sync-writes")
        plain_files = capture(url, tmp_path / "p")
    got = ops_in(sync_rows)
    assert got["prepare"] == kinds.count("p") and got["commit"] == kinds.count("c")
    assert got["abort"] == kinds.count("a")
    assert not {"prepare", "commit", "abort"} & set(ops_in(plain_rows))
    # with sync writes every marker is V2.0 and says where the visible items end
    markers = [r for r in sync_rows if r["op"] == "snapshot_marker"]
    assert markers and all(r["snap_version"] == "2.0" and r["max_visible_seqno"] is not None for r in markers)
    commits = [r for r in sync_rows if r["op"] == "commit"]
    assert all(r["by_seqno"] and r["key"] for r in commits)
    assert json.loads(sync_files[0].metadata["dcptool.options"])["sync_writes"] is True
    # replay: a commit is the prepare's change at the commit seqno; prepares and aborts change
    # nothing: the documents equal those of a consumer that got only committed mutations
    sync_docs, plain_docs = docs(sync_files), docs(plain_files)
    assert sync_docs == plain_docs
    commit_seqnos = {(r["vbucket"], r["by_seqno"]) for r in commits}
    assert commit_seqnos & {(d["vbucket"], d["by_seqno"]) for d in sync_docs}
    # the value length of a committed document is its prepare's
    t = local.replay_local(sync_files).table("documents")
    by_seqno = {(r["vbucket"], r["by_seqno"]): r["value_len"] for r in t.to_pylist()}
    assert all(by_seqno[k] > 0 for k in commit_seqnos if k in by_seqno)


@pytest.mark.spark
def test_sync_writes_spark_equals_local(spark, tmp_path):
    from dcptool.replay.spark import engine as spark_engine
    model = model_with_live(3, sync_ratio=0.7, live=200)
    with ThreadedServer(model) as srv:
        files = capture(f"couchbase://{srv.host}:{srv.port}/default", tmp_path / "s", "--sync-writes")
    want = local.replay_local(files)
    rep = spark_engine.replay_spark(spark, files)
    try:
        for name in want.names():
            assert rep.table(name).equals(want.table(name)), name
    finally:
        rep.close()


# --------------------------------------------------------------------------- expiry, acks

def test_expiry_opcode_is_an_option():
    model = model_with_live(4)
    assert any(it.kind == "x" for vb in model.buckets["default"].vbuckets for it in vb.mem)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        on = stream_rows(url)
        off = stream_rows(url, "--no-expiry-opcode")

    def asked(rows):
        return any(r["op"] == "control" and r["direction"] == "out" and r["key"] == "enable_expiry_opcode"
                   for r in rows)
    assert asked(on) and not asked(off)
    assert ops_in(on).get("expiration", 0) > 0 and "expiration" not in ops_in(off)
    assert ops_in(off)["deletion"] == ops_in(on)["deletion"] + ops_in(on)["expiration"]


def test_ack_ratio_sets_when_buffers_are_acknowledged(tmp_path):
    model = P.server_from_options(vbuckets=4, items=4000, seed=5)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        files = capture(url, tmp_path / "a", "--buffer-size", "64KiB", "--ack-ratio", "0.9")
        for bad in ("0", "1.5", "-1", "half"):
            res = run("stream", url, "--ack-ratio", bad)
            assert res.returncode == 2 and "--ack-ratio" in res.stderr, bad
    t = read_capture_table(files)
    acks = [struct.unpack_from(">I", raw, 24)[0]
            for op, raw in zip(t.column("op").to_pylist(), t.column("raw").to_pylist()) if op == "buffer_ack"]
    assert acks and all(a >= 0.9 * 65536 for a in acks)
    assert json.loads(files[0].metadata["dcptool.options"])["ack_ratio"] == 0.9


# --------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("flag,control", [("--compress", "force_value_compression"),
                                          ("--sync-writes", "enable_sync_writes"),
                                          ("--expiry-opcode", "enable_expiry_opcode")])
def test_refused_control_asked_for_is_fatal(flag, control):
    model = P.server_from_options(vbuckets=2, items=50, scenarios=P.Scenarios(refuse_controls=(control,)))
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("stream", url, flag)
        assert res.returncode == 5, res.stderr
        err = [ln for ln in res.stderr.splitlines() if ln.startswith("dcptool:")]
        assert len(err) == 1 and control in err[0] and "not_supported" in err[0]
        assert "Traceback" not in res.stderr
        if control == "enable_expiry_opcode":   # not asked for: reported, and the run goes on
            res = run("stream", url)
            assert res.returncode == 0 and control in res.stderr and "continuing" in res.stderr


# --------------------------------------------------------------------------- stream --json

def test_stream_json_summary():
    model = P.server_from_options(vbuckets=4, items=300, seed=6)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        res = run("stream", url, "--json")
        assert res.returncode == 0, res.stderr
        summary = json.loads(res.stdout)        # stdout: the summary alone, no rows
        with_rows = run("stream", url, "--json", "--format", "jsonl")
    assert summary["ops"]["mutation"] == summary["items"] == 300
    assert sum(summary["ops"].values()) == summary["messages_in"] + summary["messages_out"]
    assert summary["bytes_in"] > 300 * 128 and summary["seconds"] > 0 and summary["rate"] > 0
    # with --format the summary is stderr's last line, and it counts that run's own rows (two
    # runs differ in the messages timing decides, the noops and acks: 338 against 340 once)
    rows = [json.loads(line) for line in with_rows.stdout.splitlines()]
    last = json.loads(with_rows.stderr.strip().splitlines()[-1])
    assert len(rows) == last["messages_in"] + last["messages_out"]
    assert last["ops"]["mutation"] == last["items"] == 300
    assert sum(last["ops"].values()) == len(rows)


@pytest.mark.parametrize("collections", [False, True])
def test_prebuilt_compressed_backfill_equals_the_codec(collections):
    """The compressed disk frames built once per vbucket (producer_compress.py) are the
    frames the codec makes item by item, with the stream's opaque written in."""
    from types import SimpleNamespace

    from dcptool.protocol.dcp.server.compress import compressed_disk_frames, with_opaque
    from dcptool.protocol.dcp.server.streams import encode_item
    vb = P.server_from_options(vbuckets=2, items=300, seed=8).buckets["default"].vbuckets[1]
    conn = SimpleNamespace(collections=collections, no_value=False, json=True, compress=True, sync_writes=False,
                           delete_times=True, controls={}, server=SimpleNamespace(scenarios=P.Scenarios()))
    blob, starts = compressed_disk_frames(vb, collections, False, True)
    data, rel = with_opaque(blob, starts, 5, vb.disk_high, 0xABCD)
    want = [encode_item(conn, vb.vbid, 0xABCD, vb.disk_item(s)) for s in range(6, vb.disk_high + 1)]
    assert [bytes(data[a:b]) for a, b in zip(rel, rel[1:])] == want
