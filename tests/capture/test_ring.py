"""The retention ring (`capture --retain-segments / --retain-size / --retain-age`): the oldest
finished segments go, what they held is recorded first, verify calls the head "retained
away" (exit 0), replay says its documents are the retained window's, and --resume continues
from the state the record and the segments left give together."""

from __future__ import annotations

import json
import os

import pytest

from dcptool.capture.dcp_resume import resume_from
from dcptool.capture.ring import Retention, Ring
from dcptool.replay.check.verify import verify
from dcptool.replay.store import retained
from tests.support.cli_util import run
from tests.support.ring_caps import dcp_capture, resegmented, set_finished


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """One seeded capture (4 vbuckets, 400 items) in one segment."""
    out = tmp_path_factory.mktemp("full")
    assert dcp_capture(out)["error"] is None
    return out


def _ring(tmp_path, full, **retention):
    paths = resegmented(full, tmp_path / "ring", 5)
    return paths, Ring(str(tmp_path / "ring"), "dcp", _source(paths[0]), Retention(**retention))


def _source(path) -> str:
    from dcptool.replay.store.reader import describe
    return describe(path).metadata["dcptool.source"]


def test_by_count_the_oldest_go_and_the_record_says_what_they_held(tmp_path, full):
    paths, ring = _ring(tmp_path, full, segments=2)
    # segments of another source (`capture --force-new`) or of a shard are not this ring's
    for source, shard in (("couchbase://elsewhere/default", None), (ring.source, "1/2")):
        assert Ring(ring.directory, "dcp", source, ring.retention, shard=shard).apply() == []
    assert ring.apply() == paths[:3]
    assert sorted(os.listdir(ring.directory)) == sorted([os.path.basename(p) for p in paths[3:]]
                                                        + ["dcptool-retained.json"])
    rec = retained.load(ring.record_path)
    assert rec["segments_dropped"] == 3 and list(rec["captures"].values()) == [2]
    assert sorted(rec["vbuckets"]) == ["0", "1", "2", "3"]
    # the resume state after the ring is the one of the whole capture
    assert resume_from(ring.directory)[0] == resume_from(str(full))[0]
    assert ring.apply() == []       # nothing more to do


def test_by_size_and_never_a_segment_not_yet_durable(tmp_path, full):
    paths, ring = _ring(tmp_path, full, size=1)
    # a rename not yet made durable: its .arrows twin is still there; it and what follows stay
    twin = paths[2][:-len(".parquet")] + ".arrows"
    open(twin, "wb").close()
    assert ring.apply() == paths[:2]
    os.unlink(twin)
    ring.retention = Retention(size=os.path.getsize(paths[3]) + os.path.getsize(paths[4]))
    assert ring.apply() == paths[2:3]


def test_by_age_with_the_clock_given(tmp_path, full):
    paths, ring = _ring(tmp_path, full, age=150.0)
    for i, p in enumerate(paths):
        set_finished([p], 1000.0 + 100 * i)
    ring.clock = lambda: 1450.0
    assert ring.apply() == paths[:3]       # 1450 - 1300 is not above 150
    ring.clock = lambda: 1451.0
    assert ring.apply() == paths[3:4]


def test_the_record_is_written_before_the_delete(tmp_path, full, monkeypatch):
    paths, ring = _ring(tmp_path, full, segments=4)

    def fail(path):
        assert retained.load(ring.record_path)["captures"], "deleted before the record was written"
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "unlink", fail)
    with pytest.raises(OSError):
        ring.apply()
    monkeypatch.undo()
    # the record claims a segment that is still there: verify stays clean
    assert verify([ring.directory]).counts == {}


def test_verify_says_retained_away_and_replay_notes_the_window(tmp_path, full):
    _paths, ring = _ring(tmp_path, full, segments=2)
    ring.apply()
    res = run("verify", ring.directory, "--format", "jsonl")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(x) for x in res.stdout.splitlines()]
    assert [(r["check"], r["severity"]) for r in rows] == [("file.retained_away", "info")]
    # without the record the same directory has lost segments
    os.rename(ring.record_path, ring.record_path + ".aside")
    assert "file.segment_missing" in verify([ring.directory]).counts
    os.rename(ring.record_path + ".aside", ring.record_path)
    res = run("replay", ring.directory, "--table", "documents", "--format", "jsonl")
    assert res.returncode == 0, res.stderr
    assert "dcptool: note: a retention ring dropped the oldest 3 segment(s)" in res.stderr
    assert "retained window" in res.stderr
    assert retained.note([str(full)]) is None


def test_resume_on_a_ring_continues_without_a_rollback(tmp_path, full):
    _paths, ring = _ring(tmp_path, full, segments=1)
    ring.apply()
    # the same seeded producer: every vbucket continues at its high seqno, nothing again
    res = dcp_capture(ring.directory, settings=dict(resume=True, retain_segments=1))
    assert res["error"] is None and res["stopped"] == "to"
    assert res["rollbacks"] == 0 and res["retained_away"] == 1   # the old one, once the new one is finished
    left = [n for n in os.listdir(ring.directory) if n.endswith(".parquet")]
    assert len(left) == 1 and retained.load(ring.record_path)["segments_dropped"] == 5
    assert verify([ring.directory]).counts == {"file.retained_away": 1}


def test_the_window_documents_are_the_full_captures_for_the_keys_in_it(tmp_path, full):
    from dcptool.replay.local import engine as local
    from dcptool.replay.store.reader import find_captures
    _paths, ring = _ring(tmp_path, full, segments=2)
    ring.apply()
    drop = ["capture_id", "frame_no", "ts"]

    def docs(path):
        t = local.replay_local(find_captures([str(path)])).table("documents").drop_columns(drop)
        return {(r["vbucket"], r["key"]): r for r in t.to_pylist()}
    window, whole = docs(ring.directory), docs(full)
    assert 0 < len(window) < len(whole)
    assert window == {k: whole[k] for k in window}


def test_a_synapse_ring_keeps_the_committed_tokens(tmp_path):
    from dcptool.capture.synapse_capture import resume_state
    from dcptool.replay.store.resume import synapse_resume_state
    from tests.support import capgen
    d = str(tmp_path / "syn")
    capgen.write_captures(capgen.generate("synapse", 11, n_events=300, max_captures=1), d, seed=1, max_segments=4)
    whole = synapse_resume_state([d])
    ring = Ring(d, "synapse", _source(os.path.join(d, sorted(os.listdir(d))[0])), Retention(segments=1))
    assert len(ring.apply()) == 1
    assert retained.load(ring.record_path)["streams"]
    assert resume_state(d)[0] == whole
    checks = verify([d]).counts
    assert "file.retained_away" in checks and "file.segment_missing" not in checks
