"""Adversary round 3 (issue 36), the capture store's side: outputs never overwrite inputs
(findings 1, 2), one writer per capture directory and shard (8), a torn tail is the end of a
log, not damage (12), and a capture directory's source is its bucket (13), and import resynchronises after a hole in
bounded work (4)."""

from __future__ import annotations

import os

import pyarrow.parquet as pq

from dcptool.replay.store.writer import CaptureWriter
from tests.bench.bench_segments import rows as clean_rows
from tests.support.cli_util import error_line, run

SOURCE = "couchbase://127.0.0.1:11210/default"


def _finished_capture(directory, source: str = SOURCE, rows: int = 20) -> None:
    w = CaptureWriter(directory, "dcp", source=source, options={})
    w.write(clean_rows(rows))         # protocol-clean: verify finds nothing in it
    w.close()


def _snapshot(directory) -> dict[str, bytes]:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


# ------------------------------------------------------------ 1, 2: outputs never overwrite inputs

def test_report_onto_a_segment_is_refused_and_the_segment_kept(tmp_path):
    cap = tmp_path / "caps"
    _finished_capture(cap)
    before = _snapshot(cap)
    segment = str(cap / sorted(before)[0])
    # the shell glob `report -o caps/*.parquet`: a segment right after -o
    res = run("report", "-o", segment, str(cap))
    assert res.returncode == 2, res.stderr
    assert "is a capture file" in error_line(res)
    # a page inside the capture directory is refused too (it is no capture file)
    res = run("report", str(cap), "-o", str(cap / "report.html"))
    assert res.returncode == 2 and "inside a capture directory" in error_line(res)
    assert _snapshot(cap) == before
    assert pq.read_table(segment).num_rows == 20
    res = run("report", str(cap), "-o", str(tmp_path / "report.html"))
    assert res.returncode == 0, res.stderr
    assert open(tmp_path / "report.html").read().startswith("<!DOCTYPE html>")
    assert sorted(os.listdir(tmp_path)) == ["caps", "report.html"]     # no temporary left


def test_export_onto_a_segment_is_refused_before_anything_is_opened(tmp_path):
    cap = tmp_path / "caps"
    _finished_capture(cap)
    before = _snapshot(cap)
    segment = str(cap / sorted(before)[0])
    res = run("export", str(cap), "-o", segment)
    assert res.returncode == 2, res.stderr
    assert "is a capture file" in error_line(res)
    assert _snapshot(cap) == before
    # a capture file under another name is still a capture file
    other = tmp_path / "renamed.pcapng"
    other.write_bytes(before[sorted(before)[0]])
    res = run("export", str(cap), "-o", str(other))
    assert res.returncode == 2 and "is a capture file" in error_line(res)
    assert other.read_bytes() == before[sorted(before)[0]]


def test_a_failed_export_leaves_the_old_output_whole_and_no_temporary(tmp_path):
    cap = tmp_path / "caps"
    _finished_capture(cap, rows=2000)
    seg = cap / sorted(os.listdir(cap))[0]
    data = bytearray(seg.read_bytes())
    data[100:4000] = b"\xde\xad\xbe\xef" * 975          # the footer reads, the pages do not
    seg.write_bytes(bytes(data))
    out = tmp_path / "out.pcapng"
    out.write_bytes(b"an earlier export")
    res = run("export", str(cap), "-o", str(out))
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert out.read_bytes() == b"an earlier export"
    assert sorted(os.listdir(tmp_path)) == ["caps", "out.pcapng"]


def test_import_into_a_capture_directory_is_refused(tmp_path):
    from tests.support.pcap_session import handshake, write_flow
    cap = tmp_path / "caps"
    _finished_capture(cap)
    before = _snapshot(cap)
    write_flow(str(tmp_path / "x.pcap"), handshake())
    res = run("import", str(tmp_path / "x.pcap"), "-o", str(cap))
    assert res.returncode == 2, res.stderr
    assert "is a capture directory" in error_line(res)
    assert _snapshot(cap) == before


def test_a_failed_import_leaves_no_output_and_no_temporary(tmp_path):
    from tests.support.pcap_session import handshake, write_flow
    write_flow(str(tmp_path / "x.pcap"), handshake())           # a connection with no byte: nothing to import
    res = run("import", str(tmp_path / "x.pcap"), "-o", str(tmp_path / "imp"))
    assert res.returncode == 5, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["x.pcap"]
