"""`dcptool diff`: documents added, changed and removed between two captures or two moments
of one capture; exit 0 equal, 6 different, 1 unreadable, 2 usage."""

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


def _dir(tmp, s, n=200, protocol="dcp"):
    d = tmp / f"{protocol}-{s}"
    capgen.write_captures(capgen.generate(protocol, s, n_events=n), str(d), seed=s)
    return str(d)


def _docs(rows):
    schema = T.schema_of("dcp", "documents")     # the body columns (value, ...) null
    base = dict(dict.fromkeys(schema.names), rev_seqno=1, datatype=0, item_flags=0, expiration=0,
                value_len=1, capture_id="c", frame_no=0, ts=0)
    full = [{**base, **r} for r in rows]
    return pa.Table.from_pylist(full, schema=schema)


def test_diff_documents_classifies_every_case():
    a = _docs([dict(vbucket=1, collection_id=0, key=b"same", by_seqno=1, cas=10, state="live"),
               dict(vbucket=1, collection_id=0, key=b"gone", by_seqno=2, cas=11, state="live"),
               dict(vbucket=1, collection_id=0, key=b"edit", by_seqno=3, cas=12, state="live"),
               dict(vbucket=2, collection_id=None, key=b"nullcid", by_seqno=4, cas=13, state="live"),
               dict(vbucket=1, collection_id=8, key=b"\xff", by_seqno=6, cas=15, state="live")])
    b = _docs([dict(vbucket=1, collection_id=0, key=b"same", by_seqno=1, cas=10, state="live",
                    frame_no=99, capture_id="other"),              # seen elsewhere: not a change
               dict(vbucket=1, collection_id=0, key=b"edit", by_seqno=9, cas=20, state="deleted"),
               dict(vbucket=1, collection_id=0, key=b"new", by_seqno=7, cas=21, state="live"),
               dict(vbucket=2, collection_id=None, key=b"nullcid", by_seqno=4, cas=13, state="live"),
               dict(vbucket=1, collection_id=8, key=b"\xff", by_seqno=6, cas=15, state="live")])
    out = D.diff_documents(a, b).to_pylist()
    # live -> deleted is a removal (issue 39), with both states shown
    assert [(r["change"], r["key"]) for r in out] == [("removed", b"edit"), ("removed", b"gone"), ("added", b"new")]
    edit = out[0]
    assert (edit["before_by_seqno"], edit["after_by_seqno"], edit["before_cas"], edit["after_cas"],
            edit["before_state"], edit["after_state"]) == (3, 9, 12, 20, "live", "deleted")
    assert out[1]["after_by_seqno"] is None and out[2]["before_state"] is None
    assert D.diff_documents(a, a).num_rows == 0
    assert D.summary(D.diff_documents(a, b)) == {"added": 1, "changed": 0, "removed": 2}


def test_cli_two_moments_and_two_captures(tmp_path):
    d = _dir(tmp_path, 3)
    files = reader.find_captures([d])
    ts = sorted(local.replay_local(files).table("frames").column("ts").cast(pa.int64()).to_pylist())
    t1, t2 = ts[len(ts) // 3], ts[-1]
    want = D.diff_documents(local.replay_local(files, as_of=AsOf(t1)).table("documents"),
                            local.replay_local(files, as_of=AsOf(t2)).table("documents"))
    assert want.num_rows > 0
    r = subprocess.run([DCPTOOL, "diff", d, "--at", iso_ns(t1), "--at", str(t2)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 6, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == want.num_rows
    assert [(x["change"], x["vbucket"], x["key"], x["after_by_seqno"]) for x in rows] == [
        (w["change"], w["vbucket"], w["key"].decode(), w["after_by_seqno"]) for w in want.to_pylist()]
    assert "added" in r.stderr and "Traceback" not in r.stderr
    # a capture against itself: equal, nothing printed, exit 0
    r = subprocess.run([DCPTOOL, "diff", d, d], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == ""
    # two different captures: exit 6
    r = subprocess.run([DCPTOOL, "diff", d, _dir(tmp_path, 4)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 6 and r.stdout


def test_cli_errors(tmp_path):
    d = _dir(tmp_path, 3)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    r = subprocess.run([DCPTOOL, "diff", d, str(bad)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    r = subprocess.run([DCPTOOL, "diff", d, str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    for args in ([d], [d, d, d], [d, "--at", "2026-01-01T00:00:00Z"], [d, "--at", "nope", "--at", "1"]):
        r = subprocess.run([DCPTOOL, "diff", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (args, r.stderr)
    syn = _dir(tmp_path, 3, protocol="synapse")
    r = subprocess.run([DCPTOOL, "diff", syn, syn], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "DCP" in r.stderr
