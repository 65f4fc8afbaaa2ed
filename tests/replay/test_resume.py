"""Resume state derived from captures on disk, and recovery of in-progress segments."""

from __future__ import annotations

import os
import random
import shutil

import pyarrow.parquet as pq

from dcptool.replay.store.resume import (
    VbResume,
    dcp_resume_state,
    recover_in_progress,
    synapse_resume_state,
)
from tests.support.capture_rows import Rec


def test_dcp_resume_state_per_vbucket(tmp_path):
    r = Rec(tmp_path)
    r.stream_ok(0, [(111, 0)])
    r.stream_ok(1, [(222, 5), (221, 0)])
    r.marker(0, 0, 10)
    r.items(0, 1, 10)
    r.marker(1, 0, 5)
    r.items(1, 1, 5)
    r.add(op="noop")
    r.marker(0, 11, 20)
    r.items(0, 11, 15)
    r.add(op="stream_end", vbucket=1, stream_end_reason=0)
    # vb 2: a rollback after items up to 8
    r.stream_ok(2, [(333, 0)])
    r.marker(2, 0, 8)
    r.items(2, 1, 8)
    r.add(op="stream_req", vbucket=2, status=0x23, rollback_seqno=3)
    # vb 3: a complete snapshot, then a marker with nothing after it
    r.stream_ok(3, [(444, 0)])
    r.marker(3, 0, 4)
    r.items(3, 1, 3)
    r.items(3, 4, 4, op="seqno_advanced")
    r.marker(3, 5, 9)
    # frames going out never count as received
    r.add(direction="out", op="mutation", vbucket=3, by_seqno=99)
    r.close()

    st = dcp_resume_state([str(tmp_path)])
    assert sorted(st) == [0, 1, 2, 3]
    assert st[0].failover_log == [(111, 0)] and st[0].vbucket_uuid == 111
    assert (st[0].last_seqno, st[0].snap_start, st[0].snap_end, st[0].snapshot_complete) == (15, 11, 20, False)
    assert st[0].stream_request() == {"start_seqno": 15, "vbucket_uuid": 111, "snap_start": 11, "snap_end": 20}
    assert not st[0].ended
    assert st[1].failover_log == [(222, 5), (221, 0)]
    assert (st[1].last_seqno, st[1].snapshot_complete, st[1].ended) == (5, True, True)
    assert st[1].stream_request() == {"start_seqno": 5, "vbucket_uuid": 222, "snap_start": 5, "snap_end": 5}
    # rolled back into the snapshot 0..8 (it may be deduplicated): back to its start, the
    # end of the last whole snapshot at or below 3 (PROTOCOLS.md "Consumer rules")
    assert (st[2].last_seqno, st[2].snapshot_complete, st[2].rollbacks) == (0, True, 1)
    assert st[2].stream_request()["start_seqno"] == 0
    assert (st[3].last_seqno, st[3].snap_start, st[3].snap_end, st[3].snapshot_complete) == (4, 0, 4, True)
    assert st[3].stream_request() == {"start_seqno": 4, "vbucket_uuid": 444, "snap_start": 4, "snap_end": 4}


def test_later_capture_wins_and_a_new_request_clears_ended(tmp_path):
    r = Rec(tmp_path)
    r.stream_ok(0, [(1, 0)])
    r.marker(0, 0, 3)
    r.items(0, 1, 3)
    r.add(op="stream_end", vbucket=0, stream_end_reason=0)
    r.close()
    assert dcp_resume_state(tmp_path)[0].ended
    r2 = Rec(tmp_path)                                  # the --resume run
    r2.stream_ok(0, [(2, 3), (1, 0)])
    r2.marker(0, 4, 9)
    r2.items(0, 4, 6)
    r2.close()
    st = dcp_resume_state(tmp_path)[0]
    assert st.failover_log == [(2, 3), (1, 0)]
    assert (st.last_seqno, st.snap_start, st.snap_end, st.snapshot_complete, st.ended) == (6, 4, 9, False, False)


def _reference(rows) -> dict[int, tuple]:
    """Every row, one at a time: what the vectorised skip must agree with."""
    st: dict[int, list] = {}
    for row in rows:
        if row.get("direction") != "in" or row.get("vbucket") is None:
            continue
        s = st.setdefault(row["vbucket"], [0, 0, 0, True, None])  # last, ss, se, complete, pending
        if row.get("op") == "snapshot_marker":
            if s[0] >= s[2] or row["snap_start"] > s[2]:
                s[3] = True
            s[4] = (row["snap_start"], row["snap_end"])
        elif row.get("by_seqno") is not None and row.get("status") is None:
            if s[4]:
                s[1], s[2] = s[4]
                s[4] = None
            s[0] = row["by_seqno"]
            s[3] = s[0] >= s[2]
    return {vb: tuple(v[:4]) for vb, v in st.items()}


def test_skipping_items_agrees_with_a_row_by_row_pass_across_segments(tmp_path):
    rng = random.Random(11)
    r = Rec(tmp_path, rotate_size=40_000)
    all_rows = []
    seq = {vb: 0 for vb in range(6)}
    for _ in range(400):
        vb = rng.randrange(6)
        size = rng.randrange(1, 12)
        r.marker(vb, seq[vb] + 1, seq[vb] + size)
        upto = seq[vb] + (size if rng.random() < 0.7 else rng.randrange(0, size))
        for s in range(seq[vb] + 1, upto + 1):
            r.add(op=rng.choice(["mutation", "deletion", "expiration"]), vbucket=vb, by_seqno=s)
        if upto > seq[vb]:
            seq[vb] = upto
        if rng.random() < 0.3:
            r.add(op="noop")
        all_rows.extend(r.rows)
        r.flush()
    segs = r.close()
    assert len(segs) > 2
    st = dcp_resume_state([tmp_path])
    got = {vb: (s.last_seqno, s.snap_start, s.snap_end, s.snapshot_complete) for vb, s in st.items()}
    assert got == _reference(all_rows)


def test_recover_in_progress_then_resume_reads_it(tmp_path):
    live_dir, dead = tmp_path / "live", tmp_path / "dead"
    r = Rec(live_dir)
    r.stream_ok(5, [(55, 0)])
    r.marker(5, 0, 7)
    r.items(5, 1, 4)
    r.flush()
    r.w.flush()
    dead.mkdir()
    shutil.copy(r.w.in_progress, dead)               # what a SIGKILLed run leaves
    assert recover_in_progress(live_dir) == []       # a live writer's file is left alone
    r.close()
    # the in-progress file is readable as it is ...
    st = dcp_resume_state([dead])
    assert (st[5].last_seqno, st[5].snapshot_complete) == (4, False)
    # ... and becomes a normal segment
    done = recover_in_progress(dead)
    assert len(done) == 1 and done[0].endswith("-000000.parquet")
    assert os.listdir(dead) == [os.path.basename(done[0])]
    pq.read_table(done[0]).validate(full=True)
    assert dcp_resume_state([dead])[5].stream_request() == \
        {"start_seqno": 4, "vbucket_uuid": 55, "snap_start": 0, "snap_end": 7}
    assert recover_in_progress(tmp_path / "missing") == []


def test_synapse_resume_state_batch_token_rule(tmp_path):
    r = Rec(tmp_path, protocol="synapse")
    r.add(command="POSITION", stream="events", instance="master", prev_token=0, new_token=10)
    r.add(command="RDATA", stream="events", instance="master", token=11, row="[]")
    r.add(command="RDATA", stream="events", instance="master", batch=True, row="[]")
    r.add(command="RDATA", stream="events", instance="master", batch=True, row="[]")   # waiting
    r.add(command="RDATA", stream="caches", instance="w1", batch=True, row="[]")
    r.add(command="RDATA", stream="caches", instance="w1", token=40, row="[]")
    r.add(command="RDATA", stream="typing", instance="master", batch=True, row="[]")   # never committed
    r.add(command="PING", args="123")
    r.add(direction="out", command="REPLICATE")
    r.close()
    assert synapse_resume_state([tmp_path]) == {("events", "master"): 11, ("caches", "w1"): 40}


def test_empty_and_wrong_protocol_directories(tmp_path):
    assert dcp_resume_state([tmp_path]) == {}
    r = Rec(tmp_path, protocol="synapse")
    r.add(command="RDATA", stream="events", instance="master", token=3, row="[]")
    r.close()
    assert dcp_resume_state([tmp_path]) == {}
    assert isinstance(VbResume(1).stream_request(), dict)
