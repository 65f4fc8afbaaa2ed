"""A capture recorded from the built-in producer with a forced failover, replayed: the
`documents` table equals the producer's own final state of the bucket, `rollbacks` lists
each rollback with the number of changes it undid, and the Spark engine agrees."""

from __future__ import annotations

import pytest

from dcptool.replay.local import engine as local
from dcptool.replay.store.reader import read_capture_table

pytestmark = pytest.mark.integration
STATE = {"m": "live", "d": "deleted", "x": "expired"}


def test_documents_equal_the_producers_final_state(failover_capture):
    model, files = failover_capture
    docs = local.replay_local(files).table("documents")
    got = {(r["vbucket"], r["key"]): (r["by_seqno"], r["rev_seqno"], r["cas"], r["state"])
           for r in docs.select(["vbucket", "key", "by_seqno", "rev_seqno", "cas", "state"]).to_pylist()}
    want = {(vb.vbid, key): (it.seqno, it.rev, it.cas, STATE[it.kind])
            for vb in model.buckets["default"].vbuckets for key, it in vb.latest().items()}
    assert got == want


def test_rollbacks_list_the_rollback_with_what_it_undid(failover_capture):
    model, files = failover_capture
    rb = local.replay_local(files).table("rollbacks").to_pylist()
    assert rb, "the failover produced no rollback"
    # count independently: items of that vbucket above the rollback seqno received before it
    t = read_capture_table(files, ["direction", "op", "vbucket", "by_seqno", "status", "frame_no",
                                   "rollback_seqno"]).to_pylist()
    for r in rb:
        before = [x for x in t if x["frame_no"] < r["frame_no"] and x["vbucket"] == r["vbucket"]
                  and x["direction"] == "in" and x["op"] in ("mutation", "deletion", "expiration")]
        earlier_rollbacks = [x for x in rb if x["vbucket"] == r["vbucket"] and x["frame_no"] < r["frame_no"]]
        assert not earlier_rollbacks  # one failover: one rollback per vbucket
        assert r["undone"] == sum(1 for x in before if x["by_seqno"] > r["rollback_seqno"])
    assert sum(r["undone"] for r in rb) > 0
    vbs = {r["vbucket"]: r for r in local.replay_local(files).table("vbuckets").to_pylist()}
    for r in rb:
        assert vbs[r["vbucket"]]["rollbacks"] >= 1


@pytest.mark.spark
def test_spark_gives_the_same_tables(failover_capture, spark):
    from dcptool.replay.rules import tables as T
    from dcptool.replay.spark import engine as spark_engine
    _, files = failover_capture
    ref = local.replay_local(files)
    got = spark_engine.replay_spark(spark, files)
    for name in T.table_names("dcp"):
        assert T.checksum(name, got.table(name)) == T.checksum(name, ref.table(name)), name
