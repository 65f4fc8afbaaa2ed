"""Rollback forensics: the `undone` table lists exactly the changes a rollback undid (against
an independent count from the frames and against what the built-in producer rewrote in its
failover), `explain_rollbacks` tells the failover entries and the seqno range, and Spark SQL,
DuckDB and the row-by-row oracle (tests/support/oracle.py) give the same `undone` table."""

from __future__ import annotations

import os

import pytest

from dcptool.replay.check import forensics
from dcptool.replay.local import engine as local
from dcptool.replay.store import reader
from dcptool.replay.store.reader import read_capture_table
from tests.support import capgen, oracle

CHANGES = ("mutation", "deletion", "expiration")


def _independent_undone(files) -> set:
    """From the frames alone: per rollback, the changes of its vbucket received before it
    (and after any earlier rollback of it) with by_seqno above the rollback seqno."""
    t = read_capture_table(files, ["direction", "op", "vbucket", "by_seqno", "status", "frame_no",
                                   "rollback_seqno", "collection_id", "key"]).to_pylist()
    out, last = set(), {}
    for x in t:    # one capture: frame order is frame_no order
        if x["direction"] != "in":
            continue
        if x["op"] == "stream_req" and x["status"] == 0x23 and x["rollback_seqno"] is not None:
            vb = x["vbucket"]
            for y in t:
                if (y["direction"] == "in" and y["op"] in CHANGES and y["vbucket"] == vb
                        and last.get(vb, -1) < y["frame_no"] < x["frame_no"] and y["by_seqno"] > x["rollback_seqno"]):
                    out.add((vb, x["frame_no"], y["collection_id"], y["key"], y["by_seqno"]))
            last[vb] = x["frame_no"]
    return out


@pytest.mark.integration
def test_undone_lists_exactly_the_changes_undone(failover_capture):
    model, files = failover_capture
    assert len({f.capture_id for f in files}) == 1
    rep = local.replay_local(files)
    undone = rep.table("undone").to_pylist()
    assert undone, "the failover undid nothing the consumer had received"
    got = {(u["vbucket"], u["frame_no"], u["collection_id"], u["key"], u["by_seqno"]) for u in undone}
    assert got == _independent_undone(files)
    assert len(undone) == sum(rep.table("rollbacks").column("undone").to_pylist())
    # the producer's truth: the consumer streamed on to the end of the new branch, so every
    # undone document is restored at the producer's latest seqno for it; a change above the
    # branch point is one the producer lost, and it rewrote that key on the new branch
    # (a rollback may go below the branch point: to the start of the consumer's snapshot)
    rb = {r["vbucket"]: r["rollback_seqno"] for r in rep.table("rollbacks").to_pylist()}
    vbs = {vb.vbid: vb for vb in model.buckets["default"].vbuckets}
    lost = 0
    for u in undone:
        vb = vbs[u["vbucket"]]
        branch = vb.failover_log[0][1]
        it = vb.latest()[u["key"]]
        assert u["restored"] and u["restored_seqno"] == it.seqno, u
        assert u["rollback_seqno"] == rb[u["vbucket"]] <= branch and u["by_seqno"] > u["rollback_seqno"]
        if u["by_seqno"] > branch:
            lost += 1
            assert it.seqno > branch and it.value.startswith(b'{"branch"'), u
    assert lost > 0


@pytest.mark.integration
def test_explain_rollbacks_tells_failover_entries_and_range(failover_capture):
    model, files = failover_capture
    rep = local.replay_local(files)
    undone = rep.table("undone").to_pylist()
    explained = forensics.explain_rollbacks(files)
    assert len(explained) == rep.table("rollbacks").num_rows
    vbs = {vb.vbid: vb for vb in model.buckets["default"].vbuckets}
    for e in explained:
        vb = vbs[e["vbucket"]]
        new_uuid, branch = vb.failover_log[0]
        assert e["rollback_seqno"] <= branch
        under = next((u, s) for u, s in vb.failover_log if s <= e["rollback_seqno"])
        assert e["failover_entry"] == {"vbucket_uuid": under[0], "seqno": under[1]}
        assert e["failover_after"] == [{"vbucket_uuid": u, "seqno": s} for u, s in vb.failover_log]
        assert e["failover_before"] == [{"vbucket_uuid": u, "seqno": s} for u, s in vb.failover_log[1:]]
        assert e["requested_vbucket_uuid"] == vb.failover_log[1][0]
        assert e["undone_from"] == e["rollback_seqno"] + 1
        mine = [u for u in undone if u["vbucket"] == e["vbucket"]]
        assert e["undone_changes"] == len(mine)
        if mine:
            assert e["undone_to"] >= max(u["by_seqno"] for u in mine)
            assert sorted(s for d in e["documents"] for s in d["by_seqnos"]) == sorted(u["by_seqno"] for u in mine)
            assert all(d["restored"] and isinstance(d["key"], str) for d in e["documents"])
        assert e["ts"].endswith("Z")


def test_undone_on_generated_captures(tmp_path):
    """Restored means the document's current change came after the rollback."""
    seen = {True: 0, False: 0}
    for s in range(6):
        d = tmp_path / str(s)
        capgen.write_captures(capgen.generate("dcp", s, n_events=200), str(d), seed=s)
        rep = local.replay_local(reader.find_captures([str(d)]))
        docs = {(x["vbucket"], x["collection_id"], x["key"]): x for x in rep.table("documents").to_pylist()}
        undone = rep.table("undone").to_pylist()
        assert len(undone) == sum(rep.table("rollbacks").column("undone").to_pylist())
        for u in undone:
            doc = docs.get((u["vbucket"], u["collection_id"], u["key"]))
            seen[u["restored"]] += 1
            if u["restored"]:
                assert doc is not None and doc["by_seqno"] == u["restored_seqno"]
                assert doc["ts"] >= u["ts"]
            else:
                assert u["restored_seqno"] is None
    assert seen[True] and seen[False], seen


@pytest.mark.spark
def test_spark_undone_equals_local(spark, tmp_path):
    """Spark SQL `undone`, the local engine's (DuckDB) and the row-by-row oracle's agree."""
    from dcptool.replay.spark import engine as spark_engine
    total = 0
    for s in range(4):
        d = tmp_path / str(s)
        capgen.write_captures(capgen.generate("dcp", s, n_events=200), str(d), seed=s)
        files = reader.find_captures([str(d)])
        want = local.replay_local(files, tables=["undone"]).table("undone")
        total += want.num_rows
        assert oracle.dcp(files)["undone"].equals(want)
        rep = spark_engine.replay_spark(spark, files)
        try:
            assert rep.table("undone").equals(want)
        finally:
            rep.close()
    assert total > 0


def test_verify_explain_prints_every_rollback_after_a_clean_verdict(failover_capture):
    """`dcptool verify --explain`: the producer's failover capture is clean (exit 0), and the
    rows after the findings are explain_rollbacks' rows, one per rollback."""
    import json

    from click.testing import CliRunner

    from dcptool.cli import cli
    model, files = failover_capture
    paths = sorted({os.path.dirname(f.path) for f in files})
    res = CliRunner().invoke(cli, ["verify", *paths, "--explain", "--format", "jsonl"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.strip()]
    want = forensics.explain_rollbacks(files)
    assert want and rows == json.loads(json.dumps(want))
