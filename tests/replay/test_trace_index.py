"""The key index of finished segments (replay/store/key_index.py) and trace's reads through
it (replay/check/trace_read.py): the capture writer writes a Bloom filter per row group that
picks exactly the row groups holding a key; trace reads only those, and only the snapshot
markers its story needs, and tells the same story as a full read, on captures with and
without the index (an old capture falls back to reading every row group)."""

from __future__ import annotations

import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay.check import trace as T
from dcptool.replay.check import trace_read as R
from dcptool.replay.store import key_index, segment
from dcptool.replay.store.schema import capture_schema
from tests.support import capgen


def test_xxh64_known_values():
    # the reference implementation's values (xxhash.h test vectors, seed 0)
    assert key_index.xxh64(b"") == 0xEF46DB3751D8E999
    assert key_index.xxh64(b"a") == 0xD24EC4F1A98C6E5B
    assert key_index.xxh64(b"abc") == 0x44BC2CF5AD770999


def _rows(keys: list[bytes], vb: int) -> pa.RecordBatch:
    t = capgen.to_table("dcp", [{"frame_no": i, "op": "mutation", "direction": "in", "key": k, "vbucket": vb,
                                 "magic": 0x80, "ts": 1_763_800_000_000_000_000 + i}
                                for i, k in enumerate(keys)])
    return t.to_batches()[0]


def test_capture_writer_writes_an_index_that_picks_the_row_groups(tmp_path):
    final = str(tmp_path / "dcp-20251122T000000.000000Z-b0000000-000000.parquet")
    seg = segment.ParquetSegment(final, capture_schema("dcp"), "zstd")
    groups = [[b"g%d-%d" % (g, i) for i in range(500)] for g in range(3)]
    for g, keys in enumerate(groups):
        seg.add(_rows(keys, vb=10 * g))
        seg.flush_row_group()
    seg.finish()
    md = pq.read_metadata(final)
    assert md.num_row_groups == 3 and key_index.has_index(md)
    for g, keys in enumerate(groups):
        for k in keys[::50]:
            assert key_index.row_groups_for(final, md, [k]) == [g]
    assert key_index.row_groups_for(final, md, [b"g0-1", b"g2-7"]) == [0, 2]
    assert key_index.row_groups_for(final, md, [b"never"]) == []
    # the vbucket statistics prune too: g1 keys live in vbucket 10
    assert key_index.row_groups_for(final, md, [b"g1-3"], {11}) == []
    assert key_index.row_groups_for(final, md, [b"g1-3"], {10}) == [1]
    # a segment written without the index says so
    plain = str(tmp_path / "plain.parquet")
    pq.write_table(pq.read_table(final), plain)
    assert key_index.row_groups_for(plain, pq.read_metadata(plain), [b"g0-1"]) is None
    assert not key_index.has_index(pq.read_metadata(plain))


def _with_index(src: str, dst: str) -> None:
    """The captures of `src` re-encoded as the capture writer encodes (segment.parquet_writer
    with its key index), row group for row group; in-progress files copied."""
    os.makedirs(dst)
    for name in sorted(os.listdir(src)):
        if not name.endswith(".parquet"):
            shutil.copy(os.path.join(src, name), dst)
            continue
        pf = pq.ParquetFile(os.path.join(src, name))
        w = None
        for rg in range(pf.metadata.num_row_groups):
            t = pf.read_row_group(rg)
            if w is None:
                w = segment.parquet_writer(os.path.join(dst, name), pf.schema_arrow, "zstd",
                                           key_index.bloom_options(pf.schema_arrow, t, segment.ROW_GROUP_BYTES,
                                                                   segment.ROW_GROUP_ROWS))
            w.write_table(t, row_group_size=max(1, t.num_rows))
        w.close()


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    base = tmp_path_factory.mktemp("trace_index")
    caps = capgen.generate("dcp", seed=27, n_events=500, max_captures=2)
    old = str(base / "old")
    capgen.write_captures(caps, old, seed=27, max_segments=2, in_progress_last=True, row_group_size=7)
    new = str(base / "new")
    _with_index(old, new)
    keys = sorted({k for _, t in caps for k in t.column("key").to_pylist() if k is not None})
    return old, new, keys + [b"never-seen"]


def _full_read(monkeypatch):
    """trace as before the index: every row group, every snapshot marker."""
    needed = R.markers_needed
    monkeypatch.setattr(R, "key_groups", lambda f, keys, vbs: None)
    monkeypatch.setattr(R, "markers_needed", lambda probes, ranks, anchors: needed(probes, ranks, None))


def test_trace_with_and_without_the_index_tells_the_same_story(captures, monkeypatch):
    old, new, keys = captures
    assert len(keys) > 10
    R.STATS.update(dict.fromkeys(R.STATS, 0))
    indexed = T.trace([new], keys)
    assert R.STATS["indexed"] > 0 and R.STATS["unindexed"] == 0
    assert R.STATS["row_groups_read"] < R.STATS["row_groups"]
    R.STATS.update(dict.fromkeys(R.STATS, 0))
    fallback = T.trace([old], keys)
    assert R.STATS["indexed"] == 0 and R.STATS["unindexed"] > 0
    with monkeypatch.context() as m:
        _full_read(m)
        full = T.trace([old], keys)
    assert indexed == fallback == full
    assert any(r["event"] == "change" and r["snapshot_start"] is not None for r in full)
    assert full[-1]["verdict"] == "not_seen"
    for k in keys[:: max(1, len(keys) // 8)]:     # one key at a time, as a user asks
        assert T.trace([new], [k]) == [r for r in full if r["key"] == k.decode()]
    # a key never seen in a streamed vbucket: "streamed to seqno N", the highest snapshot end
    # (of the finished segments alone: an in-progress one is read whole)
    def finished(d):
        return [os.path.join(d, n) for n in sorted(os.listdir(d)) if n.endswith(".parquet")]
    vbs = sorted({r["vbucket"] for r in full if r["event"] == "change"})[:3]
    unseen = [T.trace(finished(new), [b"never-seen"], vbucket=vb)[0] for vb in vbs]
    with monkeypatch.context() as m:
        _full_read(m)
        assert unseen == [T.trace(finished(old), [b"never-seen"], vbucket=vb)[0] for vb in vbs]
    assert any("to seqno" in v["explain"] for v in unseen)


def test_a_recovered_in_progress_segment_gets_the_index(tmp_path):
    """`capture --resume` finishes a leftover `.arrows` through the same segment finishing."""
    caps = capgen.generate("dcp", seed=5, n_events=60, max_captures=1)
    paths = capgen.write_captures(caps, str(tmp_path), seed=5, max_segments=1, in_progress_last=True)
    done = segment.finish_in_progress(paths[-1])
    md = pq.read_metadata(done["path"])
    assert done["rows"] > 0 and key_index.has_index(md)
    key = next(k for k in pq.read_table(done["path"], columns=["key"]).column("key").to_pylist() if k)
    assert key_index.row_groups_for(done["path"], md, [key]) == [0]
