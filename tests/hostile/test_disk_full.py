"""`dcptool capture` on a disk that fills up (issue 14.9): the capture stops by itself
with one error line naming the file and the OS error (exit 1); every finished segment is
whole; the segment being written is finished or removed, never left half written; no
`.parquet.tmp` stays behind.

The full disk is a write hook, so the test runs everywhere (no mount, no root): a wrapper
process replaces pyarrow's OS file and Parquet writer sinks with Python files whose writes
fail with ENOSPC once the capture directory holds `LIMIT` bytes, as a small file system
would (a partial write first, then the error; removing a file gives its space back)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap
import time

import pyarrow.parquet as pq
import pytest

from dcptool.protocol.dcp.server import producer as P
from tests.support.paths import DCPTOOL, ROOT
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration

FULL_DISK = textwrap.dedent("""
    import errno, io, os, sys, threading
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory, limit = os.path.realpath(sys.argv[1]), int(sys.argv[2])
    lock = threading.Lock()

    def used():
        total = 0
        for e in os.scandir(directory):
            try:
                total += e.stat().st_size
            except FileNotFoundError:   # removed meanwhile by another thread
                pass
        return total

    class SmallDisk(io.FileIO):
        def write(self, data):
            data = memoryview(data).cast("B")
            with lock:
                room = limit - used()
                if room >= len(data):
                    return super().write(data)
                if room > 0:
                    super().write(data[:room])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)

    def on_small_disk(path, mode):
        return os.path.dirname(os.path.realpath(path)) == directory and ("w" in mode or "a" in mode)

    real_osfile = pa.OSFile

    def osfile(path, mode="r", **kw):
        if on_small_disk(path, mode):
            return pa.PythonFile(SmallDisk(path, mode.replace("b", "")), mode="w")
        return real_osfile(path, mode, **kw)

    class ParquetWriter(pq.ParquetWriter):
        def __init__(self, where, *args, **kw):
            self._small = None
            if isinstance(where, str) and on_small_disk(where, "w"):
                self._small = where = pa.PythonFile(SmallDisk(where, "w"), mode="w")
            super().__init__(where, *args, **kw)

        def close(self):
            try:
                super().close()
            finally:
                if self._small is not None:
                    self._small.close()

    pa.OSFile = osfile
    pq.ParquetWriter = ParquetWriter
    from dcptool.cli import main
    main(sys.argv[3:])
""")


def _capture_on_small_disk(out, limit, url, *args, timeout=90):
    cmd = [sys.executable, "-c", FULL_DISK, str(out), str(limit), "capture", url, "-o", str(out),
           "--quiet", *args]
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return proc, time.monotonic() - started


@pytest.mark.parametrize("limit", [300_000, 1_200_000, 4_000_000])
def test_capture_stops_on_a_full_disk_and_leaves_only_whole_segments(tmp_path, limit):
    out = tmp_path / "caps"
    out.mkdir()
    # far more than fits: a capture that ignored the error would run until --duration
    model = P.server_from_options(vbuckets=16, items=60_000, seed=7, value_size=200)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        proc, _ = _capture_on_small_disk(out, limit, url, "--rotate-size", "256KiB", "--to", "forever",
                                         "--duration", "60s")
    # it stopped by itself (the subprocess timeout bounds the wait), with exit 1
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dcptool:")]
    assert len(errors) == 1, proc.stderr
    assert "No space left on device (ENOSPC)" in errors[0] and str(out) in errors[0]
    names = sorted(os.listdir(out))
    assert not [n for n in names if n.endswith(".tmp")], names
    assert not [n for n in names if n.endswith(".arrows")], names   # finished or removed
    finished = sorted(glob.glob(str(out / "*.parquet")))
    frame_nos = []
    for path in finished:
        t = pq.read_table(path)
        t.validate(full=True)
        frame_nos += t.column("frame_no").to_pylist()
    # what was kept is the start of the capture, in order, without a hole (at 300 kB not
    # even the first receive batch fits: nothing is kept, and the message says so)
    assert frame_nos == list(range(len(frame_nos)))
    if limit > 1_000_000:
        assert frame_nos


def test_background_writer_reports_its_death_to_the_network_side():
    """The DCP capture pauses its consumer while the writer's queue is long; a writer that
    dies must wake it (on_error), or the capture would wait for ever at 0% CPU."""
    import threading

    from dcptool.replay.store.background import BackgroundWriter
    from dcptool.replay.store.writer import WriterError
    from tests.support.batches import SlowWriter, dcp_batch
    seen = []
    called = threading.Event()
    slow = SlowWriter(fail=WriterError("cannot write capture segment /x: No space left on device"))
    bg = BackgroundWriter(slow, on_error=lambda exc: (seen.append(exc), called.set()))
    bg.submit(dcp_batch(0, 10))
    slow.release.set()
    assert called.wait(30)
    assert seen == [bg.error] and isinstance(seen[0], WriterError)
    with pytest.raises(WriterError):
        bg.close()


def test_output_under_a_file_is_one_line_and_exit_2(tmp_path):
    """-o below a regular file can never be a directory: a usage error (exit 2, issue 24
    item 14: as `-o /dev/null` and `-o FILE`), one error line naming the path (and click's hint), nothing on stdout."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    model = P.server_from_options(vbuckets=4, items=100, seed=1)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        proc = subprocess.run([DCPTOOL, "capture", url,
                               "-o", str(blocker / "sub"), "--quiet"],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("dcptool:")]   # a usage error's line
    assert len(errors) == 1 and str(blocker / "sub") in errors[0] and "not a directory" in errors[0], proc.stderr


def test_salvage_finishes_the_segment_from_memory_when_its_copy_leaves_no_room(tmp_path, monkeypatch):
    """The last resort of the writer: no room for the Parquet file next to the in-progress
    copy, so the rows go through memory into the space the copy gave back."""
    from dcptool.replay.store import writer as W
    from tests.support.batches import dcp_batch
    w = W.CaptureWriter(tmp_path, "dcp", source="s", options={}, rotate_size=0)
    for i in range(4):
        w.write(dcp_batch(i * 500, 500))
    w.flush()
    arrows = w.in_progress
    real = W.finish_in_progress

    def no_room(path, compression="zstd"):
        assert os.path.exists(path)
        raise W.WriterError(f"cannot write capture segment {path}: No space left on device (ENOSPC)")

    monkeypatch.setattr(W, "finish_in_progress", no_room)
    w._abandon_segment()
    monkeypatch.setattr(W, "finish_in_progress", real)
    assert not os.path.exists(arrows)
    assert [s["rows"] for s in w.segments] == [2000]
    t = pq.read_table(w.segments[0]["path"])
    t.validate(full=True)
    assert t.column("frame_no").to_pylist() == list(range(2000))
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(w.segments[0]["path"])]
