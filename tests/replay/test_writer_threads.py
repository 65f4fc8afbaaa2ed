"""The capture writer's encoder thread (replay/store/encoder.py): row groups reach every file in
frame order across row groups and rotations; a failure on the encoder thread is the same
one-line WriterError as a failure anywhere else and loses no row already written; the queue in
front of the encoder is bounded (the writer waits, counted, instead of piling up row groups);
`--compression lz4` files read back identically."""

from __future__ import annotations

import errno
import glob
import os
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay.store import COMPRESSIONS, segment
from dcptool.replay.store.encoder import RowGroupEncoder
from dcptool.replay.store.segment import ParquetSegment, finish_in_progress
from dcptool.replay.store.writer import CaptureWriter, WriterError


def batch(start: int, n: int, rng: np.random.Generator) -> pa.RecordBatch:
    fn = np.arange(start, start + n, dtype=np.int64)
    return pa.record_batch({
        "frame_no": fn,
        "conn": pa.array(np.zeros(n, np.int32)),
        "raw": pa.array([b"\x81\x57" + rng.bytes(int(rng.integers(30, 300))) for _ in range(n)]),
        "key": pa.array([b"k%d" % i for i in fn]),
        "vbucket": pa.array((fn % 7).astype(np.uint16)),
    })


def frame_nos(paths) -> list[int]:
    out = []
    for p in sorted(paths):
        t = pq.read_table(p)
        t.validate(full=True)
        out += t["frame_no"].to_pylist()
    return out


def test_rows_in_frame_order_across_row_groups_and_rotations(tmp_path, monkeypatch):
    monkeypatch.setattr(segment, "ROW_GROUP_BYTES", 30_000)
    rng = np.random.default_rng(7)
    w = CaptureWriter(tmp_path, "dcp", source="s", options={}, rotate_size=600_000)
    start = 0
    for _ in range(120):
        n = int(rng.integers(1, 200))
        w.write(batch(start, n, rng))
        start += n
        if rng.random() < 0.3:
            w.flush()
    segs = w.close()
    assert len(segs) >= 3
    groups = [pq.ParquetFile(s["path"]).metadata.num_row_groups for s in segs]
    assert sum(groups) >= 2 * len(segs), groups
    assert frame_nos(s["path"] for s in segs) == list(range(start))
    # one thread encoded every row group of every segment, one queue in front of it
    assert w.encoder.done == sum(groups)
    assert w.encoder.peak_outstanding <= w.encoder.max_outstanding
    assert not glob.glob(str(tmp_path / "*.arrows")) and not glob.glob(str(tmp_path / "*.tmp"))


@pytest.mark.parametrize("fail_at", [2, 7])
def test_encoder_failure_is_the_usual_error_and_loses_nothing_written(tmp_path, monkeypatch, fail_at):
    monkeypatch.setattr(segment, "ROW_GROUP_BYTES", 30_000)
    real = ParquetSegment._write_row_group
    calls = []

    def full_disk(self, batches):
        calls.append(self.tmp)
        if len(calls) == fail_at:       # once: the salvage after it may write again
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.tmp)
        return real(self, batches)

    monkeypatch.setattr(ParquetSegment, "_write_row_group", full_disk)
    rng = np.random.default_rng(fail_at)
    w = CaptureWriter(tmp_path, "dcp", source="s", options={}, rotate_size=150_000)
    start, accepted, err = 0, 0, None
    for _ in range(200):
        n = int(rng.integers(50, 150))
        try:
            w.write(batch(start, n, rng))
            w.flush()               # every accepted row is in the in-progress file
        except WriterError as exc:
            err = exc
            break
        start += n
        accepted = start
    else:
        with pytest.raises(WriterError) as info:
            w.close()
        err = info.value
    assert err is not None, "the injected failure never surfaced"
    msg = str(err)
    failed_tmp = calls[fail_at - 1]
    assert msg.startswith(f"cannot write capture segment {failed_tmp}: ")
    assert "No space left on device" in msg and "\n" not in msg
    with pytest.raises(WriterError) as again:
        w.close()
    assert again.value is err
    # nothing already written is lost: every accepted row is in a whole Parquet segment
    got = frame_nos(glob.glob(str(tmp_path / "*.parquet")))
    assert got[:accepted] == list(range(accepted))
    assert got == sorted(set(got))
    assert not glob.glob(str(tmp_path / "*.tmp"))
    assert w.encoder is not None and w.encoder.outstanding == 0


def test_the_queue_in_front_of_the_encoder_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(segment, "ROW_GROUP_BYTES", 10_000)
    real = ParquetSegment._write_row_group
    gate = threading.Event()

    def held(self, batches):
        gate.wait(60)
        return real(self, batches)

    monkeypatch.setattr(ParquetSegment, "_write_row_group", held)
    rng = np.random.default_rng(3)
    w = CaptureWriter(tmp_path, "dcp", source="s", options={}, rotate_size=0)
    w.write(batch(0, 100, rng))
    w.flush()
    enc = w.encoder
    assert isinstance(enc, RowGroupEncoder)
    batches = [batch(100 + i * 100, 100, rng) for i in range(30)]   # ~30 row groups
    done = threading.Event()
    errors = []

    def produce():
        try:
            for b in batches:
                w.write(b)
                w.flush()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=produce, daemon=True)
    t.start()
    with enc._cv:
        assert enc._cv.wait_for(lambda: enc.stalls >= 1 or done.is_set(), timeout=60)
    # the encoder is held: the writer waits with the queue full instead of handing over more
    assert enc.stalls >= 1 and not done.is_set()
    assert enc.outstanding == enc.max_outstanding
    gate.set()
    t.join(60)
    assert not t.is_alive() and not errors
    (seg,) = w.close()
    assert enc.peak_outstanding == enc.max_outstanding
    assert frame_nos([seg["path"]]) == list(range(3100))


def test_encoder_runs_jobs_in_order_and_bounds_its_queue():
    enc = RowGroupEncoder(max_outstanding=1)
    order = []
    futs = [enc.submit(order.append, i) for i in range(50)]
    enc.close()
    assert order == list(range(50)) and all(f.done() for f in futs)
    assert enc.peak_outstanding == 1
    with pytest.raises(RuntimeError):
        enc.submit(order.append, 0)
    with pytest.raises(ValueError):
        RowGroupEncoder(max_outstanding=0)


def test_lz4_files_read_back_identically(tmp_path):
    assert "lz4" in COMPRESSIONS
    rng = np.random.default_rng(11)
    w = CaptureWriter(tmp_path / "a", "dcp", source="s", options={}, compression="lz4")
    sent = [batch(i * 500, 500, rng) for i in range(6)]
    for b in sent:
        w.write(b)
    (seg,) = w.close()
    pf = pq.ParquetFile(seg["path"])
    md = pf.metadata
    # pyarrow's "lz4" is Parquet's LZ4_RAW codec; random frame bytes, which LZ4 cannot
    # shrink, are stored as they are (segment.column_compression)
    codecs = {md.row_group(0).column(i).path_in_schema: md.row_group(0).column(i).compression
              for i in range(md.num_columns)}
    assert codecs.pop("raw") == "UNCOMPRESSED"
    assert set(codecs.values()) == {"LZ4"}
    got = pf.read()
    want = pa.Table.from_batches(sent)
    for name in want.column_names:
        assert got[name].to_pylist() == want[name].to_pylist(), name
    # a leftover in-progress segment is finished with lz4 too
    w2 = CaptureWriter(tmp_path / "b", "dcp", source="s", options={}, compression="lz4")
    w2.write(sent[0])
    w2.flush()
    arrows = w2.in_progress
    done = finish_in_progress(arrows, "lz4")
    assert done is None      # the live writer holds its lock: left alone
    w2.close()
    assert pq.read_table(glob.glob(str(tmp_path / "b" / "*.parquet"))[0])["raw"].to_pylist() == \
        want["raw"].to_pylist()[:500]


def _raw_codec(path) -> str:
    md = pq.ParquetFile(path).metadata
    (codec,) = {md.row_group(g).column(i).compression for g in range(md.num_row_groups)
                for i in range(md.num_columns) if md.row_group(g).column(i).path_in_schema == "raw"}
    return codec


@pytest.mark.parametrize("compression", ["lz4", "zstd", "snappy"])
def test_raw_is_compressed_only_where_the_codec_pays(tmp_path, compression):
    rng = np.random.default_rng(5)
    n = 2000
    texts = [b"\x80\x57" + b'{"name":"user-%06d","city":"Lyon","tags":["a","b","c"]}' % i * 4 for i in range(n)]
    cases = {"random": [b"\x80\x57" + rng.bytes(300) for _ in range(n)],   # ~600 KB: judged
             "text": texts,                                                  # repeats: shrinks
             "few": [b"\x80\x57" + rng.bytes(30) for _ in range(100)]}     # 3 KB: too little to judge
    want = {"random": "UNCOMPRESSED", "text": compression.upper(), "few": compression.upper()}
    for name, raws in cases.items():
        w = CaptureWriter(tmp_path / name, "dcp", source="s", options={}, compression=compression)
        rb = pa.record_batch({"frame_no": np.arange(len(raws), dtype=np.int64), "raw": pa.array(raws)})
        w.write(rb)
        (seg,) = w.close()
        assert _raw_codec(seg["path"]) == want[name], name
        assert pq.read_table(seg["path"])["raw"].to_pylist() == raws


def test_the_encoder_lets_go_of_a_finished_job_at_once():
    """A row group in its file frees its batches (and the receive buffers under them) before
    the next job comes, not when it does (issue 26: buffers the transport takes back)."""
    import weakref

    class Rows:
        pass

    enc = RowGroupEncoder()
    rows = Rows()
    gone = weakref.ref(rows)
    done = threading.Event()
    enc.submit(lambda r: done.set(), rows).result(10)
    del rows
    with enc._cv:             # the thread has counted the job done: it holds nothing of it
        enc._cv.wait_for(lambda: enc.done == 1, 10)
    assert gone() is None
    enc.close()
