"""The capture writer: schema, metadata, naming, rotation, compression, SASL masking, the
in-progress form, recovery after SIGKILL, disk errors and the background thread."""

from __future__ import annotations

import datetime as dt
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay.store import schema as S
from dcptool.replay.store import segment
from dcptool.replay.store import writer as W
from dcptool.replay.store.background import BackgroundWriter
from dcptool.replay.store.redact import mask_sasl_credentials
from dcptool.replay.store.segment import finish_in_progress, open_in_progress
from dcptool.replay.store.writer import CaptureWriter, WriterError
from tests.support.batches import SlowWriter, dcp_batch

PY = sys.executable


def read_all(paths) -> pa.Table:
    tables = []
    for p in sorted(paths):
        t = pq.read_table(p)
        t.validate(full=True)
        tables.append(t)
    return pa.concat_tables(tables, promote_options="permissive") if tables else None


def test_round_trip_schema_metadata_and_order(tmp_path):
    w = CaptureWriter(tmp_path, "dcp", source="couchbase://h/b",
                      options={"vbuckets": [0, 1], "password": "hunter2", "nested": {"secret": 1}})
    w.write(dcp_batch(0, 500))
    w.write(pa.Table.from_batches([dcp_batch(500, 300), dcp_batch(800, 200)]))
    segs = w.close()
    assert [s["rows"] for s in segs] == [1000]
    path = segs[0]["path"]
    assert os.path.basename(path) == W.segment_name("dcp", dt.datetime.strptime(
        w.started_at, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=dt.timezone.utc), w.capture_id, 0)
    assert os.listdir(tmp_path) == [os.path.basename(path)]
    pf = pq.ParquetFile(path)
    expected = S.capture_schema("dcp")
    got = pf.schema_arrow
    assert [(f.name, f.type) for f in got] == [(f.name, f.type) for f in expected]
    meta = {k.decode(): v.decode() for k, v in pf.metadata.metadata.items()}
    for key in S.META_KEYS:
        assert key in meta
    assert meta[S.META_FORMAT] == S.FORMAT_VERSION == "2" and meta[S.META_PROTOCOL] == "dcp"
    assert meta[S.META_CAPTURE_ID] == w.capture_id and meta[S.META_SEGMENT] == "0"
    assert meta[S.META_SOURCE] == "couchbase://h/b"
    assert json.loads(meta[S.META_OPTIONS]) == {"vbuckets": [0, 1], "nested": {}}
    assert "hunter2" not in open(path, "rb").read().decode("latin-1")
    t = pq.read_table(path)
    t.validate(full=True)
    assert t["frame_no"].to_pylist() == list(range(1000))
    assert set(t["capture_id"].to_pylist()) == {w.capture_id}
    assert t["status"].null_count == 1000           # missing columns are null
    assert t["by_seqno"].to_pylist()[:3] == [1, 2, 3]
    assert pf.metadata.row_group(0).column(0).compression == "ZSTD"


@pytest.mark.parametrize("compression,codec", [("zstd", "ZSTD"), ("lz4", "LZ4"), ("snappy", "SNAPPY"),
                                                ("none", "UNCOMPRESSED")])
def test_compression(tmp_path, compression, codec):
    w = CaptureWriter(tmp_path, "dcp", source="s", options={}, compression=compression)
    w.write(dcp_batch(0, 100))
    (seg,) = w.close()
    md = pq.ParquetFile(seg["path"]).metadata
    assert {md.row_group(0).column(i).compression for i in range(md.num_columns)} == {codec}


def test_bad_input_is_refused(tmp_path):
    w = CaptureWriter(tmp_path, "dcp", source="s", options={})
    with pytest.raises(ValueError, match="not in the dcp capture schema"):
        w.write(pa.record_batch({"frame_no": [0], "command": ["PING"]}))
    with pytest.raises(ValueError, match="frame_no"):
        w.write(pa.record_batch({"raw": [b"x"]}))
    w.write(dcp_batch(10, 5))
    with pytest.raises(ValueError, match="increase"):
        w.write(dcp_batch(12, 5))
    with pytest.raises(ValueError, match="increase"):
        w.write(pa.record_batch({"frame_no": pa.array([20, 19], pa.int64())}))
    assert [s["rows"] for s in w.close()] == [5]


def test_rotation_by_size_numbers_segments_and_keeps_every_row(tmp_path):
    w = CaptureWriter(tmp_path, "dcp", source="s", options={}, rotate_size=64 * 1024)
    for i in range(40):
        w.write(dcp_batch(i * 250, 250))
    segs = w.close()
    assert len(segs) > 3
    names = [os.path.basename(s["path"]) for s in segs]
    assert [n.rsplit("-", 1)[1] for n in names] == [f"{i:06d}.parquet" for i in range(len(segs))]
    assert sorted(os.listdir(tmp_path)) == sorted(names)     # no .arrows, no .tmp left
    t = read_all(s["path"] for s in segs)
    assert t["frame_no"].to_pylist() == list(range(10_000))
    for s in segs:
        md = pq.ParquetFile(s["path"]).schema_arrow.metadata
        assert md[b"dcptool.segment"] == str(int(s["path"][-14:-8])).encode()
        assert pq.ParquetFile(s["path"]).metadata.num_rows == s["rows"]


def test_a_segment_that_fails_to_finish_after_rotation_is_reported_and_removed(tmp_path, monkeypatch):
    """Rotation finishes the old segment on a helper thread; its disk error still reaches
    the caller as a WriterError naming the file. A segment that cannot be finished (here:
    never) is removed, never left half written; the one in progress is finished; the
    message says both."""
    import errno
    real_finish = W.ParquetSegment.finish

    def finish(self):
        if self.final.endswith("-000000.parquet"):
            raise OSError(errno.ENOSPC, "No space left on device", self.tmp)
        return real_finish(self)

    monkeypatch.setattr(W.ParquetSegment, "finish", finish)
    w = CaptureWriter(tmp_path, "dcp", source="s", options={}, rotate_size=64 * 1024)
    with pytest.raises(WriterError) as exc:
        for i in range(40):
            w.write(dcp_batch(i * 250, 250))
        w.close()
    msg = str(exc.value)
    assert "000000.parquet.tmp" in msg and "No space left on device (ENOSPC)" in msg and "\n" not in msg
    assert "-000000.arrows: its 250 rows could not be saved" in msg
    with pytest.raises(WriterError):
        w.close()
    left = sorted(os.listdir(tmp_path))
    assert not any(n.endswith((".arrows", ".tmp")) for n in left)
    assert [n for n in left if n.endswith(".parquet")] == [os.path.basename(s["path"]) for s in w.segments]
    assert not any(s["path"].endswith("-000000.parquet") for s in w.segments)
    if w.segments:
        assert read_all([s["path"] for s in w.segments]).num_rows == sum(s["rows"] for s in w.segments)


def test_rotation_by_time(tmp_path):
    w = CaptureWriter(tmp_path, "synapse", source="synapse://h:1", options={},
                      rotate_interval=60.0)
    w.write(pa.record_batch({"frame_no": pa.array([0], pa.int64()), "command": ["PING"]}))
    w.tick(now=time.monotonic() + 61)           # an idle minute later: segment 0 is done
    assert len(w.segments) == 1
    w.tick(now=time.monotonic() + 200)          # nothing new: no empty segment
    w.write(pa.record_batch({"frame_no": pa.array([1], pa.int64()), "command": ["PING"]}))
    segs = w.close()
    assert [s["rows"] for s in segs] == [1, 1]
    assert segs[1]["path"].endswith("-000001.parquet")


def test_mask_sasl_credentials():
    key = b"PLAIN"
    value = b"\x00admin\x00s3cret"
    frame = bytes([0x80, 0x21]) + len(key).to_bytes(2, "big") + b"\x00\x00\x00\x00" + \
        (len(key) + len(value)).to_bytes(4, "big") + b"\x00" * 12 + key + value
    masked = mask_sasl_credentials(frame)
    assert len(masked) == len(frame)
    assert masked[:24 + len(key)] == frame[:24 + len(key)]
    assert masked[24 + len(key):] == b"*" * len(value)
    # flexible framing: framing extras length in byte 2, key length in byte 3
    flex = bytes([0x08, 0x22, 2, len(key), 0, 0, 0, 0]) + (2 + len(key) + len(value)).to_bytes(4, "big") \
        + b"\x00" * 12 + b"\x01\x02" + key + value
    assert mask_sasl_credentials(flex) == flex[:26 + len(key)] + b"*" * len(value)
    # other frames, responses and garbage pass unchanged
    resp = bytes([0x81]) + frame[1:]
    assert mask_sasl_credentials(resp) == resp
    assert mask_sasl_credentials(b"\x80\x21") == b"\x80\x21"
    mutation = bytes([0x80, 0x57]) + frame[2:]
    assert mask_sasl_credentials(mutation) == mutation


def test_writer_masks_sasl_frames_it_is_given(tmp_path):
    key, value = b"PLAIN", b"\x00admin\x00s3cret"
    sasl = bytes([0x80, 0x21]) + len(key).to_bytes(2, "big") + b"\x00" * 4 + \
        (len(key) + len(value)).to_bytes(4, "big") + b"\x00" * 12 + key + value
    w = CaptureWriter(tmp_path, "dcp", source="s", options={})
    w.write(pa.record_batch({"frame_no": pa.array([0, 1, 2], pa.int64()),
                             "direction": ["out", "out", "in"],
                             "raw": [b"\x80\x1f" + b"\x00" * 22, sasl, None]}))
    w.flush()
    ip = w.in_progress
    assert b"s3cret" not in open(ip, "rb").read()
    (seg,) = w.close()
    raw = pq.read_table(seg["path"])["raw"].to_pylist()
    assert raw[1] == mask_sasl_credentials(sasl) and b"s3cret" not in raw[1]
    assert raw[0] == b"\x80\x1f" + b"\x00" * 22 and raw[2] is None
    assert b"s3cret" not in open(seg["path"], "rb").read()


def test_in_progress_segment_is_readable_and_torn_tails_lose_whole_batches_only(tmp_path):
    w = CaptureWriter(tmp_path, "dcp", source="s", options={"a": 1})
    for i in range(5):
        w.write(dcp_batch(i * 100, 100))
        w.flush()                                   # one IPC message per batch
    ip = w.in_progress
    assert ip.endswith(".arrows") and os.path.basename(ip).startswith("dcp-")
    schema, batches = open_in_progress(ip)
    assert schema.metadata[b"dcptool.capture_id"] == w.capture_id.encode()
    assert sum(b.num_rows for b in batches) == 500
    data = open(ip, "rb").read()
    rng = random.Random(7)
    cuts = sorted(rng.sample(range(1, len(data)), 60)) + [len(data)]
    seen = set()
    for cut in cuts:
        p = tmp_path / "cut" / os.path.basename(ip)
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(data[:cut])
        schema, batches = open_in_progress(str(p))
        rows = pa.Table.from_batches(list(batches), schema=schema) if schema else None
        n = rows.num_rows if rows is not None else 0
        assert n % 100 == 0                         # whole batches only
        if n:
            rows.validate(full=True)
            assert rows["frame_no"].to_pylist() == list(range(n))
        seen.add(n)
    assert 0 in seen and 500 in seen and len(seen) > 2
    w.close()


@pytest.mark.parametrize("value,compressed", [(b"\0" * 4096, True), (None, False)])
def test_in_progress_compression_follows_the_data(tmp_path, value, compressed):
    """LZ4 on the in-progress copy only where it pays; either way every row reads back."""
    rng = np.random.default_rng(1)
    n = 600
    batch = dcp_batch(0, n)
    values = [value if value is not None else rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
              for _ in range(n)]
    raw = pa.array([r + v for r, v in zip(batch.column("raw").to_pylist(), values)], pa.binary())
    batch = batch.set_column(batch.schema.get_field_index("raw"), "raw", raw)
    assert W.ipc_compression(batch) == ("lz4" if compressed else None)
    w = CaptureWriter(tmp_path, "dcp", source="s", options={})
    w.write(batch)
    w.flush()
    size = os.path.getsize(w.in_progress)
    assert size < raw.nbytes / 4 if compressed else size > raw.nbytes
    schema, batches = open_in_progress(w.in_progress)
    got = pa.Table.from_batches(list(batches), schema=schema)
    assert got.column("raw").to_pylist() == raw.to_pylist()
    seg, = w.close()
    assert pq.read_table(seg["path"]).column("raw").to_pylist() == raw.to_pylist()


def test_row_groups_encoded_in_the_background_keep_every_row_in_order(tmp_path, monkeypatch):
    monkeypatch.setattr(segment, "ROW_GROUP_BYTES", 20_000)   # the Parquet segment buffers row groups
    w = CaptureWriter(tmp_path, "dcp", source="s", options={})
    for i in range(40):
        w.write(dcp_batch(i * 50, 50))
        w.flush()
    seg, = w.close()
    pf = pq.ParquetFile(seg["path"])
    assert pf.metadata.num_row_groups > 5
    t = pf.read()
    t.validate(full=True)
    assert t["frame_no"].to_pylist() == list(range(2000))


def test_finish_in_progress_turns_leftovers_into_segments(tmp_path):
    w = CaptureWriter(tmp_path / "live", "dcp", source="s", options={})
    w.write(dcp_batch(0, 300))
    w.flush()
    ip = w.in_progress
    # a live writer holds the lock: recovery leaves its file alone
    assert finish_in_progress(ip) is None and os.path.exists(ip)
    # a copy stands for the file a SIGKILLed run left behind
    dead = tmp_path / "dead"
    dead.mkdir()
    shutil.copy(ip, dead / os.path.basename(ip))
    w.close()
    res = finish_in_progress(str(dead / os.path.basename(ip)))
    assert res["rows"] == 300 and res["path"] == str(dead / os.path.basename(ip)).replace(".arrows", ".parquet")
    assert os.listdir(dead) == [os.path.basename(res["path"])]
    t = pq.read_table(res["path"])
    t.validate(full=True)
    assert t["frame_no"].to_pylist() == list(range(300))
    assert pq.ParquetFile(res["path"]).schema_arrow.metadata[b"dcptool.capture_id"] == w.capture_id.encode()
    # killed between rename and unlink: the whole Parquet file wins, the leftover goes
    shutil.copy(res["path"], res["path"] + ".tmp")
    open(str(dead / os.path.basename(ip)), "wb").write(b"garbage")
    assert finish_in_progress(str(dead / os.path.basename(ip))) is None
    assert os.listdir(dead) == [os.path.basename(res["path"])]
    # an empty or schema-less leftover is simply removed
    empty = dead / "dcp-x-000001.arrows"
    empty.write_bytes(b"")
    started = dead / "dcp-x-000001.parquet.tmp"     # killed before its first batch
    started.write_bytes(b"PAR1")
    assert finish_in_progress(str(empty)) is None and not empty.exists() and not started.exists()


def test_unwritable_directory_is_a_one_line_writer_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(WriterError) as e:
        CaptureWriter(blocker / "sub", "dcp", source="s", options={})
    msg = str(e.value)
    assert "\n" not in msg and str(blocker / "sub") in msg


DISK_CHILD = textwrap.dedent("""
    import os, sys, resource, signal, json
    import numpy as np, pyarrow as pa
    from dcptool.replay.store.writer import CaptureWriter, WriterError
    out, mode = sys.argv[1], sys.argv[2]
    if mode == "efbig":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000))
    w = CaptureWriter(out, "dcp", source="s", options={}, rotate_size=150_000)
    rng = np.random.default_rng(1)
    i = 0
    try:
        while i < 200_000:
            n = 500
            if i == 4000:
                w.rotate_size = 0        # a few finished segments, then one that grows
            w.write(pa.record_batch({"frame_no": np.arange(i, i + n, dtype=np.int64),
                                     "raw": pa.array([rng.bytes(100) for _ in range(n)])}))
            i += n
        w.close()
        print(json.dumps({"error": None}))
    except WriterError as exc:
        try:
            w.close()
        except WriterError as again:
            assert again is exc
        print(json.dumps({"error": str(exc), "segments": w.segments}))
""")


def _tmpfs_runner(directory):
    if shutil.which("unshare") is None:
        return None
    probe = subprocess.run(["unshare", "-rm", "sh", "-c",
                            f"mount -t tmpfs -o size=64k none {directory} && umount {directory}"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        return None
    return ["unshare", "-rm", "sh", "-c",
            f'mount -t tmpfs -o size=1500k none {directory} && "$0" "$@"; '
            f'rc=$?; mkdir -p {directory}.copy; cp -a {directory}/. {directory}.copy/; exit $rc']


@pytest.mark.parametrize("mode", ["efbig", "enospc"])
def test_disk_full_keeps_finished_segments_whole(tmp_path, mode):
    out = tmp_path / "caps"
    out.mkdir()
    cmd = [PY, "-c", DISK_CHILD, str(out), mode]
    if mode == "enospc":
        prefix = _tmpfs_runner(out)
        if prefix is None:
            pytest.skip("cannot mount a small tmpfs here")
        cmd = prefix + cmd
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["error"], "the writer should have hit the limit"
    assert "\n" not in report["error"] and str(out) in report["error"]
    look = tmp_path / "caps.copy" if mode == "enospc" else out
    finished = sorted(glob.glob(str(look / "*.parquet")))
    assert len(finished) == len(report["segments"]) >= 1
    t = read_all(finished)                       # every finished segment is whole
    assert t["frame_no"].to_pylist() == list(range(t.num_rows))
    assert not glob.glob(str(look / "*.tmp"))    # the partial Parquet file is gone


def test_background_writer_backlog_and_no_drops():
    slow = SlowWriter()
    bg = BackgroundWriter(slow, max_queue_bytes=10_000)
    batches = [dcp_batch(i * 100, 100) for i in range(20)]
    for b in batches:
        bg.submit(b)                                # never blocks, never drops
    assert bg.backlog_bytes >= sum(b.nbytes for b in batches[1:])
    assert bg.congested
    slow.release.set()
    assert bg.close() == [{"rows": 2000}]
    assert bg.backlog_bytes == 0
    assert [b["frame_no"][0].as_py() for b in slow.got] == [i * 100 for i in range(20)]


def test_background_writer_surfaces_disk_errors():
    slow = SlowWriter(fail=WriterError("cannot write capture segment /x: No space left on device"))
    bg = BackgroundWriter(slow)
    bg.submit(dcp_batch(0, 10))
    slow.release.set()
    bg._thread.join(30)
    assert isinstance(bg.error, WriterError)
    with pytest.raises(WriterError):
        bg.submit(dcp_batch(10, 10))
    with pytest.raises(WriterError, match="No space"):
        bg.close()


def test_background_writer_real_writer(tmp_path):
    w = CaptureWriter(tmp_path, "dcp", source="s", options={}, rotate_size=200_000)
    bg = BackgroundWriter(w, max_queue_bytes=1 << 20)
    for i in range(50):
        bg.submit(dcp_batch(i * 200, 200), block=True)
    segs = bg.close()
    assert sum(s["rows"] for s in segs) == 10_000
    t = read_all(s["path"] for s in segs)
    assert t["frame_no"].to_pylist() == list(range(10_000))


CRASH_CHILD = textwrap.dedent("""
    import os, sys, time
    import numpy as np, pyarrow as pa
    from dcptool.replay.store.background import BackgroundWriter
    from dcptool.replay.store.writer import CaptureWriter
    out, log = sys.argv[1], sys.argv[2]
    w = CaptureWriter(out, "dcp", source="s", options={}, rotate_size=1_500_000,
                      flush_interval=1.0)
    bg = BackgroundWriter(w)
    logf = open(log, "w", buffering=1)
    i = 0
    while True:
        n = 400
        fn = np.arange(i, i + n, dtype=np.int64)
        raw = pa.array([b"frame-%d-" % k + b"x" * (k % 50) for k in fn])
        bg.submit(pa.record_batch({"frame_no": fn, "raw": raw, "by_seqno": fn * 3}))
        i += n
        logf.write(f"{i} {time.time()}\\n")   # rows 0..i-1 handed over at this moment
        time.sleep(0.003)
""")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_keeps_everything_older_than_one_second(tmp_path, seed):
    from dcptool.replay.store.segment import finish_in_progress
    rng = random.Random(seed)
    out, log = tmp_path / "caps", tmp_path / "log"
    proc = subprocess.Popen([PY, "-c", CRASH_CHILD, str(out), str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while (not log.exists() or log.stat().st_size < 10) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(1.2 + rng.random() * 2.5)        # a seeded random moment to kill at
        kill_time = time.time()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    handed = [tuple(map(float, line.split())) for line in log.read_text().splitlines()
              if len(line.split()) == 2]
    must_have = max((int(n) for n, t in handed if t < kill_time - 1.0), default=0)
    assert must_have > 0
    for arrows in sorted(glob.glob(str(out / "*.arrows"))):
        finish_in_progress(arrows)
    assert not glob.glob(str(out / "*.arrows")) and not glob.glob(str(out / "*.tmp"))
    t = read_all(glob.glob(str(out / "*.parquet")))
    fn = t["frame_no"].to_numpy()
    assert len(fn) >= must_have
    assert (fn == np.arange(len(fn))).all()          # nothing missing, nothing torn
    raw = t["raw"].to_pylist()
    for k in list(range(0, len(fn), 997)) + [len(fn) - 1]:
        assert raw[k] == b"frame-%d-" % k + b"x" * (k % 50)
    assert t["by_seqno"].to_pylist()[-1] == (len(fn) - 1) * 3


def test_runs_of_small_batches_merge_and_large_ones_pass_uncopied():
    small = [pa.record_batch({"frame_no": np.arange(i, i + 1, dtype=np.int64)}) for i in range(3)]
    big_rows = pa.record_batch({"frame_no": np.arange(10, 10 + W.COALESCE_MIN_ROWS, dtype=np.int64)})
    big_bytes = pa.record_batch({"raw": pa.array([b"x" * W.COALESCE_MIN_BYTES])})   # one large value
    out = W._coalesced([small[0], small[1], big_rows, small[2], big_bytes])
    assert [b.num_rows for b in out] == [2, W.COALESCE_MIN_ROWS, 1, 1]
    assert out[0].column(0).to_pylist() == [0, 1]
    assert out[1] is big_rows and out[2] is small[2] and out[3] is big_bytes   # not copied
    assert W._coalesced([]) == []
