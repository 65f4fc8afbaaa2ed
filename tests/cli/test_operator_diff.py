"""Issue 39 (an operator's day), `diff`: a document that went from live to deleted/expired is
removed (and back is added), each counted; a moment outside the capture is one line, exit 2,
naming its first and last moment; `--at start|end|+DURATION|-DURATION`."""

from __future__ import annotations

import json
import subprocess

import pyarrow as pa

from dcptool.replay.check import diff as D
from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import AsOf
from dcptool.replay.store import reader
from dcptool.replay.timestamps import iso_ns
from tests.support import capgen
from tests.support.paths import DCPTOOL


def _dir(tmp, s, n=200):
    d = tmp / f"dcp-{s}"
    capgen.write_captures(capgen.generate("dcp", s, n_events=n), str(d), seed=s)
    return str(d)


def _docs(rows):
    schema = T.schema_of("dcp", "documents")     # the body columns (value, ...) null
    base = dict(dict.fromkeys(schema.names), rev_seqno=1, datatype=0, item_flags=0, expiration=0,
                value_len=1, capture_id="c", frame_no=0, ts=0)
    return pa.Table.from_pylist([{**base, **r} for r in rows], schema=schema)


def test_live_to_deleted_is_removed_and_back_is_added_each_counted():
    a = _docs([dict(vbucket=1, collection_id=0, key=b"del", by_seqno=1, cas=10, state="live"),
               dict(vbucket=1, collection_id=0, key=b"exp", by_seqno=2, cas=11, state="live"),
               dict(vbucket=1, collection_id=0, key=b"back", by_seqno=3, cas=12, state="deleted"),
               dict(vbucket=1, collection_id=0, key=b"gone", by_seqno=4, cas=13, state="live"),
               dict(vbucket=1, collection_id=0, key=b"tomb", by_seqno=5, cas=14, state="deleted"),
               dict(vbucket=1, collection_id=0, key=b"edit", by_seqno=6, cas=15, state="live")])
    b = _docs([dict(vbucket=1, collection_id=0, key=b"del", by_seqno=7, cas=20, state="deleted"),
               dict(vbucket=1, collection_id=0, key=b"exp", by_seqno=8, cas=21, state="expired"),
               dict(vbucket=1, collection_id=0, key=b"back", by_seqno=9, cas=22, state="live"),
               dict(vbucket=1, collection_id=0, key=b"tomb", by_seqno=10, cas=23, state="expired"),
               dict(vbucket=1, collection_id=0, key=b"edit", by_seqno=11, cas=24, state="live"),
               dict(vbucket=1, collection_id=0, key=b"new", by_seqno=12, cas=25, state="live")])
    out = {r["key"]: r["change"] for r in D.diff_documents(a, b).to_pylist()}
    assert out == {b"del": "removed", b"exp": "removed", b"gone": "removed", b"back": "added",
                   b"new": "added", b"edit": "changed", b"tomb": "changed"}
    diff = D.diff_documents(a, b)
    assert D.summary(diff) == {"added": 2, "changed": 2, "removed": 3}
    assert D.breakdown(diff) == {"added": {"new": 1, "revived": 1},
                                 "removed": {"absent": 1, "deleted": 1, "expired": 1}}
    assert D.summary_line(diff, 6, 6) == ("2 added (1 new, 1 revived), 2 changed, "
                                          "3 removed (1 absent, 1 deleted, 1 expired) (6 -> 6 documents)")
    # the reverse direction: the same documents, added and removed swapped
    assert D.summary(D.diff_documents(b, a)) == {"added": 3, "changed": 2, "removed": 2}


def _span(d):
    files = reader.find_captures([d])
    ts = local.replay_local(files).table("frames").column("ts").cast(pa.int64()).drop_null().to_pylist()
    return files, min(ts), max(ts)


def _run(*args):
    return subprocess.run([DCPTOOL, "diff", *args], capture_output=True, text=True, timeout=120)


def test_a_moment_outside_the_capture_is_one_line_exit_2_naming_first_and_last(tmp_path):
    d = _dir(tmp_path, 3)
    _, first, last = _span(d)
    for at, side in ((first - 1, "before its first frame"), (last + 10**9, "after its last frame"),
                     ("+1000h", "after its last frame"), ("-1000h", "before its first frame")):
        r = _run(d, "--at", str(at), "--at", "end")
        assert r.returncode == 2, (at, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and side in lines[0], (at, r.stderr)
        assert iso_ns(first) in lines[0] and iso_ns(last) in lines[0]
        assert r.stdout == ""


def test_at_start_end_and_durations(tmp_path):
    d = _dir(tmp_path, 3)
    files, first, last = _span(d)
    want = D.diff_documents(local.replay_local(files, as_of=AsOf(first)).table("documents"),
                            local.replay_local(files, as_of=AsOf(last)).table("documents"))
    assert want.num_rows > 0
    for args in (["start", "end"], ["+0s", "-0ms"], [iso_ns(first), str(last)]):
        r = _run(d, "--at", args[0], "--at", args[1])
        assert r.returncode == 6, (args, r.stderr)
        rows = [json.loads(x) for x in r.stdout.splitlines()]
        assert [(x["change"], x["vbucket"], x["key"]) for x in rows] == [
            (w["change"], w["vbucket"], w["key"].decode()) for w in want.to_pylist()], args
        counts = D.summary(want)
        assert f"{counts['added']} added" in r.stderr and f"{counts['removed']} removed" in r.stderr
    # +DURATION counts from the first frame, -DURATION from the last
    mid = (last - first) // 2
    assert D.resolve_moment(f"+{mid / 1e9:.9f}s", (first, last), d) == first + mid
    assert D.resolve_moment("-1ms", (first, last), d) == last - 10**6
    r = _run(d, "--at", "+nope", "--at", "end")
    assert r.returncode == 2 and "Traceback" not in r.stderr
