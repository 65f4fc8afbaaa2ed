"""Point in time: `replay --as-of` / `--as-of-seqno` count only the frames of that moment,
so rollbacks received before it are honoured and later ones are not; the Spark engine
gives the same tables."""

from __future__ import annotations

import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay.local import engine as local
from dcptool.replay.rules import tables as T
from dcptool.replay.rules.as_of import AsOf, make_as_of, parse_timestamp, parse_vb_seqno
from dcptool.replay.store import reader
from dcptool.replay.timestamps import iso_ns
from tests.support import capgen
from tests.support.paths import DCPTOOL


def _files(tmp, s, n=200):
    d = tmp / f"dcp-{s}"
    capgen.write_captures(capgen.generate("dcp", s, n_events=n), str(d), seed=s)
    return reader.find_captures([str(d)])


def _truncated(tmp, files, keep) -> list:
    """The same captures with only the frames `keep` (a mask over the whole capture) left: an
    independent way to say 'as the bucket was then'."""
    out = tmp / "cut"
    out.mkdir()
    for f in files:
        t = pq.read_table(f.path)
        pq.write_table(t.filter(pa.array(keep(t))), str(out / os.path.basename(f.path)))
    return reader.find_captures([str(out)])


def test_parse_timestamp_and_seqno():
    assert parse_timestamp("1970-01-01T00:00:01.5Z") == 1_500_000_000
    assert parse_timestamp("1970-01-01T01:00:00+01:00") == 0
    assert parse_timestamp("2026-01-02T03:04:05.123456789Z") % 1_000_000_000 == 123456789
    assert parse_timestamp("123") == 123
    for bad in ("yesterday", "2026-13-01T00:00:00Z", "2026-01-01"):
        with pytest.raises(ValueError):
            parse_timestamp(bad)
    assert parse_vb_seqno("5:1200") == (5, 1200)
    for bad in ("5", "x:1", "70000:1", "1:-2"):
        with pytest.raises(ValueError):
            parse_vb_seqno(bad)
    assert make_as_of(None, ["3:9", "1:4", "3:7"]).seqnos == ((1, 4), (3, 7))


def test_as_of_equals_the_capture_cut_at_that_moment(tmp_path):
    """At every cut point, --as-of equals replaying the capture with the later frames removed;
    some cut lies between a change and the rollback that undoes it."""
    files = _files(tmp_path, 3)
    full = local.replay_local(files)
    ts = sorted(full.table("frames").column("ts").cast(pa.int64()).to_pylist())
    undone = full.table("undone")
    assert undone.num_rows > 0
    # a moment after an undone change was received and before its rollback: it still counts
    u = undone.to_pylist()[0]
    cuts = [ts[len(ts) // 4], ts[len(ts) // 2], undone.column("change_ts").cast(pa.int64())[0].as_py()]
    for i, cut in enumerate(cuts):
        got = local.replay_local(files, as_of=AsOf(cut))
        d = tmp_path / f"c{i}"
        d.mkdir()
        want = local.replay_local(_truncated(d, files, lambda t: (t.column("ts").cast(pa.int64())
                                                               .to_numpy() <= cut)))
        for name in ("documents", "vbuckets", "rollbacks", "undone", "snapshots", "frames"):
            assert T.checksum(name, got.table(name)) == T.checksum(name, want.table(name)), (cut, name)
    # the undone change is a live document at the moment between change and rollback
    at = local.replay_local(files, as_of=AsOf(cuts[2])).table("documents").to_pylist()
    assert any((d["vbucket"], d["collection_id"], d["key"], d["by_seqno"])
               == (u["vbucket"], u["collection_id"], u["key"], u["by_seqno"]) for d in at)


def test_as_of_seqno_cuts_one_vbucket(tmp_path):
    files = _files(tmp_path, 5)
    full = local.replay_local(files)
    vb = full.table("vbuckets").to_pylist()[0]
    cut = vb["high_seqno"] // 2
    got = local.replay_local(files, as_of=AsOf(None, ((vb["vbucket"], cut),)))
    docs = got.table("documents").to_pylist()
    assert all(d["by_seqno"] <= cut for d in docs if d["vbucket"] == vb["vbucket"])
    others = [d for d in full.table("documents").to_pylist() if d["vbucket"] != vb["vbucket"]]
    assert [d for d in docs if d["vbucket"] != vb["vbucket"]] == others
    new_vb = [v for v in got.table("vbuckets").to_pylist() if v["vbucket"] == vb["vbucket"]][0]
    assert new_vb["high_seqno"] <= cut


def test_cli_as_of_and_errors(tmp_path):
    files = _files(tmp_path, 3)
    d = os.path.dirname(files[0].path)
    ts = sorted(local.replay_local(files).table("frames").column("ts").cast(pa.int64()).to_pylist())
    cut = ts[len(ts) // 2]
    want = T.checksum("documents", local.replay_local(files, as_of=AsOf(cut)).table("documents"))
    for text in (iso_ns(cut), str(cut)):
        r = subprocess.run([DCPTOOL, "replay", d, "--as-of", text, "--table", "documents", "--checksum"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split()[0] == want
    r = subprocess.run([DCPTOOL, "replay", d, "--as-of", "yesterday"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "yesterday" in r.stderr
    r = subprocess.run([DCPTOOL, "replay", d, "--as-of-seqno", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "VB:SEQNO" in r.stderr


@pytest.mark.spark
def test_spark_as_of_gives_the_same_tables(spark, tmp_path):
    from dcptool.replay.spark import engine as spark_engine
    files = _files(tmp_path, 3)
    ts = sorted(local.replay_local(files).table("frames").column("ts").cast(pa.int64()).to_pylist())
    as_of = AsOf(ts[2 * len(ts) // 3], ((2, 5), (63, 40)))
    want = local.replay_local(files, as_of=as_of)
    got = spark_engine.replay_spark(spark, files, as_of=as_of)
    try:
        for name in T.table_names("dcp"):
            assert T.checksum(name, got.table(name)) == T.checksum(name, want.table(name)), name
    finally:
        got.close()
