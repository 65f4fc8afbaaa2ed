"""Compaction of small finished segments (issue 24.15; replay/store/compact.py, `dcptool
compact`, `capture` at its end): every row and byte kept, a crash at any point read right
(merged segment and its parts both there: each row once, verify clean), idempotent, the
retention ring counts a merged segment as one, in-progress segments never touched."""

from __future__ import annotations

import os
import shutil

import pytest
from click.testing import CliRunner

from dcptool.capture import ring as ring_mod
from dcptool.capture.ring import Retention, Ring
from dcptool.cli import cli
from dcptool.replay.check.verify import verify
from dcptool.replay.local.engine import replay_local
from dcptool.replay.rules import tables as T
from dcptool.replay.store import reader, retained
from dcptool.replay.store.compact import compact
from dcptool.replay.store.naming import IN_PROGRESS_SUFFIX, TMP_SUFFIX, named_range
from tests.support.ring_caps import dcp_capture, resegmented

PIECES = 12


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """One seeded capture (4 vbuckets, 200 items) in one segment."""
    out = tmp_path_factory.mktemp("full")
    assert dcp_capture(out, items=200)["error"] is None
    return out


@pytest.fixture(scope="module")
def parts(full, tmp_path_factory):
    """The same frames as PIECES segments of one capture (the capture writer's own files)."""
    d = tmp_path_factory.mktemp("parts") / "c"
    paths = resegmented(full, d, PIECES)
    assert len(paths) == PIECES
    return d


def _copy(parts, tmp_path) -> str:
    d = tmp_path / "c"
    shutil.copytree(parts, d)
    return str(d)


def _table(d):
    return reader.read_capture_table(reader.find_captures([d]))


def _checksums(d) -> dict[str, str]:
    rep = replay_local(reader.find_captures([d]))
    return {n: T.checksum(n, rep.table(n)) for n in rep.names() if n not in ("frames", "topology")}


def _clean(d):
    report = verify([d])
    assert report.findings == [], [f.message for f in report.findings]
    return report


def test_compaction_keeps_every_row_and_byte(parts, tmp_path):
    d = _copy(parts, tmp_path)
    before, sums = _table(d), _checksums(d)
    rows = _clean(d).rows
    res = compact(d)
    names = sorted(os.listdir(d))
    assert len(names) == 1 and named_range(names[0]) == (0, PIECES - 1), names
    assert res.parts_removed == PIECES and res.merged[0]["rows"] == before.num_rows
    after = _table(d)
    assert after.equals(before)                   # every column, raw bytes included, in order
    assert _checksums(d) == sums
    assert _clean(d).rows == rows
    f, = reader.find_captures([d])
    assert (f.segment, f.last_segment) == (0, PIECES - 1)
    md = reader.footer(f.path)
    assert md.row_group(0).column(0).statistics is not None   # the writer's settings


@pytest.mark.parametrize("left", ["all", "some"])
def test_crash_between_rename_and_deletes_reads_each_row_once(parts, tmp_path, left):
    d = _copy(parts, tmp_path)
    before = _table(d)
    originals = sorted(os.listdir(d))
    compact(d)
    # what a crash after the rename leaves: the merged segment and (some of) its parts
    for name in (originals if left == "all" else originals[3:7]):
        shutil.copy(os.path.join(parts, name), os.path.join(d, name))
    assert _table(d).equals(before)
    report = _clean(d)
    assert report.rows == before.num_rows
    res = compact(d)       # the next compaction deletes the leftovers, merges nothing again
    assert res.merged == [] and res.leftovers_removed == (PIECES if left == "all" else 4)
    assert len(os.listdir(d)) == 1 and _table(d).equals(before)


def test_crash_before_rename_leaves_a_tmp_nobody_reads(parts, tmp_path):
    d = _copy(parts, tmp_path)
    before = _table(d)
    merged = tmp_path / "m"
    shutil.copytree(parts, merged)
    compact(str(merged))
    name, = os.listdir(merged)
    with open(os.path.join(merged, name), "rb") as src, open(os.path.join(d, name + TMP_SUFFIX), "wb") as dst:
        dst.write(src.read()[:100])              # cut short mid-write
    assert _table(d).equals(before)
    _clean(d)
    compact(d)
    assert not [n for n in os.listdir(d) if n.endswith(TMP_SUFFIX)]
    assert _table(d).equals(before)


def test_compaction_is_idempotent(parts, tmp_path):
    d = _copy(parts, tmp_path)
    compact(d)
    listing = {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)}
    res = compact(d)
    assert res.merged == [] and res.parts_removed == 0
    assert {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)} == listing


def test_in_progress_segments_are_never_touched(parts, tmp_path):
    d = _copy(parts, tmp_path)
    names = sorted(os.listdir(d))
    last = os.path.join(d, names[-1])
    twin = last[:-len(".parquet")] + IN_PROGRESS_SUFFIX     # renamed but not yet durable
    shutil.copy(last, twin)
    kept = {p: open(p, "rb").read() for p in (last, twin)}
    res = compact(d)
    assert [named_range(os.path.basename(m["path"])) for m in res.merged] == [(0, PIECES - 2)]
    assert {p: open(p, "rb").read() for p in (last, twin)} == kept


def test_the_ring_counts_a_merged_segment_as_one(parts, tmp_path):
    d = _copy(parts, tmp_path)
    before = _table(d)
    last = sorted(os.listdir(d))[-1]
    os.rename(os.path.join(d, last), os.path.join(tmp_path, last))    # kept out of the merge
    compact(d)
    os.rename(os.path.join(tmp_path, last), os.path.join(d, last))
    for name in sorted(os.listdir(parts))[:2]:        # a crash's leftover parts: not segments
        shutil.copy(os.path.join(parts, name), os.path.join(d, name))
    source = reader.find_captures([d])[0].metadata["dcptool.source"]
    ring = Ring(d, "dcp", source, Retention(segments=1))
    assert [named_range(os.path.basename(s.path)) for s in ring.finished()] == \
        [(0, PIECES - 2), (PIECES - 1, PIECES - 1)]
    gone = ring.apply()
    assert [named_range(os.path.basename(p)) for p in gone] == [(0, PIECES - 2)]
    rec = retained.load(ring.record_path)
    cid = reader.find_captures([d])[0].capture_id
    assert rec["captures"][cid] == PIECES - 2 and rec["segments_dropped"] == 1
    report = verify([d])
    assert {f.check for f in report.findings} <= {"file.retained_away"}, [f.message for f in report.findings]
    left = _table(d)
    assert 0 < left.num_rows < before.num_rows
    assert left.column("frame_no").to_pylist() == before.column("frame_no").to_pylist()[-left.num_rows:]


def test_capture_end_compacts_its_own_source(parts, tmp_path, monkeypatch):
    d = _copy(parts, tmp_path)
    files = [{"path": f.path, "rows": 0, "bytes": 0} for f in reader.find_captures([d])]
    source = reader.find_captures([d])[0].metadata["dcptool.source"]
    assert ring_mod.compact_finished(d, source, None, files, print) == files   # fewer than COMPACT_MIN_PARTS
    assert ring_mod.compact_finished(d, "couchbase://other:11210/x", None, files, print) == files
    monkeypatch.setattr(ring_mod, "COMPACT_MIN_PARTS", PIECES)
    assert ring_mod.compact_finished(d, source, "1/2", files, print) == files   # another shard's
    out = ring_mod.compact_finished(d, source, None, files, print)
    assert [named_range(os.path.basename(f["path"])) for f in out] == [(0, PIECES - 1)]
    assert os.listdir(d) == [os.path.basename(out[0]["path"])]


def test_compact_command(parts, tmp_path):
    d = _copy(parts, tmp_path)
    runner = CliRunner()
    res = runner.invoke(cli, ["compact", d])
    assert res.exit_code == 0, res.output
    assert f"compacted {PIECES} segments into 1" in res.stderr
    res = runner.invoke(cli, ["compact", d])
    assert res.exit_code == 0 and "nothing to compact" in res.stderr
    res = runner.invoke(cli, ["compact", str(tmp_path / "nope")])
    assert res.exit_code == 2


def test_compact_refuses_a_directory_a_capture_writes_into(parts, tmp_path):
    import fcntl
    d = _copy(parts, tmp_path)
    first = sorted(os.listdir(d))[0]
    held = os.path.join(d, first.replace("-000000.parquet", "-000099" + IN_PROGRESS_SUFFIX))
    with open(held, "wb") as fh:
        fh.write(b"x")
        fcntl.flock(fh, fcntl.LOCK_EX)          # what a live writer holds
        listing = sorted(os.listdir(d))
        res = CliRunner().invoke(cli, ["compact", d])
        assert res.exit_code == 1 and "a capture is writing into it" in res.stderr, res.output
        assert "Traceback" not in res.output and sorted(os.listdir(d)) == listing
