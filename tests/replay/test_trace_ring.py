"""trace, inspect and report on a retention ring's window (issue 27 on issue 26's ring): a key
whose changes were all in the segments the ring deleted is `not_seen` with its vbucket's
dropped head told; a key changed before and after keeps its verdict and says its history up
to the dropped seqno is gone; a Synapse event of a dropped head is told the same way; inspect
and report say the capture is a retained window. The truth is the segments before the ring."""

from __future__ import annotations

import json

import pytest

from dcptool.capture.ring import Retention, Ring
from dcptool.replay.check.trace import trace, vbucket_of
from dcptool.replay.check.trace_synapse import trace_synapse
from dcptool.replay.store import retained
from dcptool.replay.store.reader import describe, find_captures, read_capture_table
from dcptool.replay.store.schema import META_OPTIONS, META_SOURCE
from dcptool.replay.store.writer import CaptureWriter
from tests.support.capture_rows import Rec
from tests.support.cli_util import run
from tests.support.ring_caps import dcp_capture, resegmented

VB = 2      # the vbucket whose key is changed before and after the dropped head


def _changes(paths) -> list[dict]:
    t = read_capture_table(find_captures(paths)).select(["op", "direction", "vbucket", "key", "by_seqno"])
    return [r for r in t.to_pylist() if r["op"] == "mutation" and r["direction"] == "in"]


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """A seeded capture (4 vbuckets, 400 items) whose last change of vbucket VB is given the key
    of its first (a key changed before and after the head), cut into 5 segments, of which a
    ring keeping 2 deletes 3. Also: the keys of the deleted and of the kept segments."""
    base = tmp_path_factory.mktemp("ring")
    assert dcp_capture(base / "full")["error"] is None
    files = find_captures([str(base / "full")])
    t = read_capture_table(files).drop_columns(["capture_id"])
    rows = t.column("key").to_pylist()
    mine = [i for i, (op, vb) in enumerate(zip(t.column("op").to_pylist(), t.column("vbucket").to_pylist()))
            if op == "mutation" and vb == VB]
    twice = rows[mine[0]]
    rows[mine[-1]] = twice
    t = t.set_column(t.column_names.index("key"), t.schema.field("key"), [rows])
    meta = files[0].metadata
    w = CaptureWriter(str(base / "edited"), "dcp", source=meta[META_SOURCE], options=json.loads(meta[META_OPTIONS]))
    w.write(t)
    w.close()
    paths = resegmented(base / "edited", base / "ring", 5)
    dropped, kept = _changes(paths[:3]), _changes(paths[3:])
    assert Ring(str(base / "ring"), "dcp", meta[META_SOURCE], Retention(segments=2)).apply() == paths[:3]
    return str(base / "ring"), twice, dropped, kept


def _last_seqno(directory: str, vb: int) -> int:
    return retained.load(f"{directory}/dcptool-retained.json")["vbuckets"][str(vb)]["last_seqno"]


def test_a_key_whose_changes_were_all_retained_away_is_not_seen_with_the_head_told(ring):
    d, _, dropped, kept = ring
    gone = next(r for r in dropped if r["key"] not in {k["key"] for k in kept} and r["vbucket"] != VB)
    vb, head = gone["vbucket"], _last_seqno(d, gone["vbucket"])
    assert gone["by_seqno"] <= head
    rows = trace([d], [gone["key"]])
    assert [r["event"] for r in rows] == ["retained_away", "verdict"]
    assert (rows[0]["vbucket"], rows[0]["seqno"]) == (vb, head)
    v = rows[-1]
    assert (v["verdict"], v["vbucket"]) == ("not_seen", vb)
    assert (f"vbucket {vb}'s changes up to seqno {head} were retained away by the ring (dcptool-retained.json); "
            "the key was not seen after that") in v["explain"]
    # a vbucket whose stream request (not its changes) the ring dropped was streamed, not "never"
    quiet = [int(q) for q, s in retained.load(f"{d}/dcptool-retained.json")["vbuckets"].items() if not s["last_seqno"]]
    key = next(k for k in (f"absent-{i}".encode() for i in range(200)) if vbucket_of(k, 4) in quiet)
    v = trace([d], [key])[-1]
    assert v["verdict"] == "not_seen" and "retained_away" not in v["explain"]
    assert (f"its vbucket {vbucket_of(key, 4)} was streamed (its stream request was retained away by the ring, "
            "dcptool-retained.json, before any change of it), without this key") in v["explain"]


def test_a_key_changed_before_and_after_the_head_keeps_its_verdict_and_says_its_history_was_dropped(ring):
    d, twice, dropped, kept = ring
    before = [r["by_seqno"] for r in dropped if r["key"] == twice]
    after = [r["by_seqno"] for r in kept if r["key"] == twice]
    head = _last_seqno(d, VB)
    assert before and after and max(before) <= head < min(after)
    rows = trace([d], [twice])
    assert rows[0]["event"] == "retained_away" and rows[0]["seqno"] == head
    assert [r["seqno"] for r in rows if r["event"] == "change"] == after
    v = rows[-1]
    assert (v["verdict"], v["seqno"]) == ("live", after[-1])
    assert v["explain"].endswith(f"its history up to seqno {head} was retained away by the ring (dcptool-retained.json)")
    # a key of the window only, of a vbucket the ring did not cut, tells nothing of it
    whole = next(r for r in kept if _last_seqno(d, r["vbucket"]) == 0)
    plain = trace([d], [whole["key"]])
    assert "retained_away" not in [r["event"] for r in plain] and "retained" not in plain[-1]["explain"]


def test_inspect_and_report_say_the_capture_is_a_retained_window(ring, tmp_path):
    d = ring[0]
    res = run("inspect", d, "--json")
    assert res.returncode == 0, res.stderr
    window = json.loads(res.stdout)["retained"]
    rec = retained.load(f"{d}/dcptool-retained.json")
    assert window["records"] == ["dcptool-retained.json"]
    assert (window["segments_dropped"], window["rows_dropped"]) == (3, rec["rows_dropped"])
    assert window["vbuckets"] == [{"vbucket": int(vb), "last_seqno": s["last_seqno"]}
                                  for vb, s in sorted(rec["vbuckets"].items(), key=lambda x: int(x[0]))]
    assert "retained window: a retention ring dropped the oldest 3 segment(s)" in run("inspect", d, "--format", "table").stdout
    res = run("report", d, "-o", str(tmp_path / "r.html"), "--no-verify")
    assert res.returncode == 0, res.stderr
    assert "retained window: a retention ring dropped the oldest 3 segment(s)" in (tmp_path / "r.html").read_text()


def test_synapse_event_of_a_dropped_head_is_told(tmp_path):
    """An event carried only in the segment the ring deleted: not_seen, the token range told."""
    rec = Rec(str(tmp_path), "synapse")
    for token, eid in ((1, "$kept-early"), (2, "$gone"), (3, "$other")):
        rec.add(command="RDATA", conn=1, ts=token, stream="events", instance="master", token=token, batch=False,
                row=json.dumps(["ev", [eid, "!room", "m.room.message"]]))
    rec.flush()
    rec.w.rotate()
    rec.add(command="RDATA", conn=1, ts=9, stream="events", instance="master", token=4, batch=False,
            row=json.dumps(["ev", ["$kept", "!room", "m.room.message"]]))
    segs = [s["path"] for s in rec.close()]
    assert Ring(str(tmp_path), "synapse", describe(segs[0]).metadata[META_SOURCE],
                Retention(segments=1)).apply() == segs[:1]
    rows = trace_synapse([str(tmp_path)], ["$gone", "$kept"])
    gone = [r for r in rows if r["event_id"] == "$gone"]
    assert [r["event"] for r in gone] == ["retained_away", "verdict"]
    assert (gone[0]["stream"], gone[0]["instance"], gone[0]["to_token"]) == ("events", "master", 3)
    assert gone[-1]["verdict"] == "not_seen"
    assert ("the rows of events/master up to token 3 were retained away by the ring (dcptool-retained.json): "
            "it may have been among them") in gone[-1]["explain"]
    assert [r["verdict"] for r in rows if r["event"] == "verdict" and r["event_id"] == "$kept"] == ["seen"]
