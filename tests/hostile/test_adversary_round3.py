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


# ------------------------------------------------------------ 12: a torn tail is not damage

def _killed_capture(directory, batches: int = 6, rows: int = 500) -> str:
    """The in-progress file a killed capture leaves in `directory`: a copy of a live writer's
    (one IPC message per batch of protocol-clean rows). Its path."""
    import shutil
    live = os.path.join(os.fspath(directory), ".live")
    w = CaptureWriter(live, "dcp", source=SOURCE, options={})
    table = clean_rows(batches * rows)
    for i in range(batches):
        w.write(table.slice(i * rows, rows))
        w.flush()
    dest = os.path.join(os.fspath(directory), os.path.basename(w.in_progress))
    shutil.copy(w.in_progress, dest)
    w.close()
    shutil.rmtree(live)
    return dest


def _jsonl(text: str) -> list[dict]:
    import json
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_a_tail_torn_mid_batch_is_truncated_on_resume_and_verify_is_clean(tmp_path):
    """What a full disk leaves: the last batch of the in-progress file cut short."""
    cap = tmp_path / "caps"
    cap.mkdir()
    path = _killed_capture(cap)
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size - 3000)                   # inside the 6th batch
    res = run("verify", str(cap), "--format", "jsonl")
    found = {f["check"]: f for f in _jsonl(res.stdout)}
    assert "file.damaged" not in found, res.stdout[:2000]
    assert found["file.torn_tail"]["severity"] == "info" and "torn tail" in found["file.torn_tail"]["message"]
    res = run("capture", "couchbase://127.0.0.1:1/default", "-o", str(cap), "--resume", "--quiet",
              "--timeout", "5s")
    assert res.returncode == 3, res.stderr            # recovered first, then the connection failed
    notes = [ln for ln in res.stderr.splitlines() if "torn tail" in ln]
    assert notes and "warning" not in notes[0] and "2,500 rows in 5 whole batches" in notes[0], res.stderr
    names = sorted(os.listdir(cap))
    assert not [n for n in names if ".damaged" in n or n.endswith(".arrows")], names
    assert pq.read_table(path[:-len(".arrows")] + ".parquet").num_rows == 2500
    res = run("verify", str(cap), "--format", "jsonl")
    assert res.returncode == 0, res.stdout[:2000]


def test_garbage_before_the_tail_is_still_damage(tmp_path):
    from dcptool.replay.store.segment import finish_in_progress
    path = _killed_capture(tmp_path)
    data = bytearray(open(path, "rb").read())
    at = len(data) // 2
    data[at:at + 200] = b"\xde\xad\xbe\xef" * 50
    open(path, "wb").write(bytes(data))
    info = finish_in_progress(path)
    assert info["damaged"] == path + ".damaged" and not info.get("torn")
    assert open(path + ".damaged", "rb").read() == bytes(data)


def test_a_capture_that_fills_a_real_small_file_system_leaves_a_clean_capture(tmp_path):
    """`capture` into a 24 MiB tmpfs until it is full (needs root to mount one; skipped
    otherwise): exit 1 with one line, then `verify` exit 0: no `.damaged` file, no hole."""
    import subprocess

    import pytest

    from dcptool.protocol.dcp.server import producer as P
    ThreadedServer = _threaded_server()
    mnt = tmp_path / "small"
    mnt.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)],
                                 capture_output=True, timeout=30).returncode == 0
    except OSError:
        mounted = False
    if not mounted:
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        out = mnt / "caps"
        model = P.server_from_options(vbuckets=16, items=200_000, seed=7, value_size=400)
        with ThreadedServer(model) as srv:
            res = run("capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", str(out), "--quiet",
                      "--to", "forever", "--duration", "60s", "--rotate-size", "4MiB", timeout=120)
        assert res.returncode == 1 and "ENOSPC" in error_line(res)
        names = os.listdir(out)
        assert names and not [n for n in names if ".damaged" in n or not n.endswith(".parquet")], names
        res = run("verify", str(out), "--format", "jsonl")
        assert res.returncode == 0, res.stdout[:2000]
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=60)


def _threaded_server():
    try:                 # where the split of protocol/transport/dcp.py (issue 35) moved it
        from tests.support.threaded_server import ThreadedServer
    except ImportError:
        from dcptool.protocol.transport.dcp import ThreadedServer
    return ThreadedServer


# ------------------------------------------------------------ 8: one writer per directory and shard

NOWHERE = "couchbase://127.0.0.1:1/default"      # refused at once: exit 3 once past the checks


def _wait_for_holder(directory, proc, deadline_s: float = 60) -> dict:
    """The lock holder a capture process wrote (polled until it appears or the process ends)."""
    import time

    from dcptool.capture.lock import holders
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and proc.poll() is None:
        found = [h for h in holders(str(directory)) if h.get("pid") == proc.pid]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no lock holder: {proc.poll()} {proc.stderr.read() if proc.poll() is not None else ''}")


def _live_capture(url, out, *args):
    import subprocess

    from tests.support.paths import DCPTOOL
    return subprocess.Popen([DCPTOOL, "capture", url, "-o", str(out), "--quiet", "--to", "forever",
                             "--duration", "120s", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def test_a_second_capture_resume_or_compact_beside_a_live_capture_is_refused(tmp_path):
    import signal

    from dcptool.protocol.dcp.server import producer as P
    out = tmp_path / "caps"
    model = P.server_from_options(vbuckets=8, items=20_000, seed=3, value_size=100)
    with _threaded_server()(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        live = _live_capture(url, out)
        try:
            holder = _wait_for_holder(out, live)
            assert holder["command"] == "capture" and holder["shard"] is None
            for args in (["capture", url, "-o", str(out), "--resume"], ["capture", url, "-o", str(out)],
                         ["capture", url, "-o", str(out), "--shard", "1/2"], ["compact", str(out)]):
                res = run(*args, *(["--quiet"] if args[0] == "capture" else []))
                assert res.returncode == 2, (args, res.stderr)
                line = error_line(res)
                assert f"pid {live.pid}" in line and "one writer per capture directory" in line, line
                assert "Errno" not in res.stderr
        finally:
            live.send_signal(signal.SIGINT)
            live.wait(60)
            live.stderr.close()
    assert live.returncode == 130
    res = run("verify", str(out))
    assert res.returncode == 0, res.stdout[-2000:]


def test_a_sigkilled_capture_leaves_no_stale_lock(tmp_path):
    import signal

    from dcptool.protocol.dcp.server import producer as P
    out = tmp_path / "caps"
    model = P.server_from_options(vbuckets=4, items=20_000, seed=3, value_size=100)
    with _threaded_server()(model) as srv:
        live = _live_capture(f"couchbase://{srv.host}:{srv.port}/default", out)
        try:
            _wait_for_holder(out, live)
        finally:
            live.send_signal(signal.SIGKILL)
            live.wait(60)
            live.stderr.close()
    res = run("capture", NOWHERE, "-o", str(out), "--resume", "--quiet", "--timeout", "5s")
    assert res.returncode == 3, res.stderr          # past the lock (and the recovery): nothing listens
    assert run("compact", str(out)).returncode == 0


def test_shards_share_a_directory_but_one_shard_has_one_writer(tmp_path):
    from dcptool.capture.lock import hold
    out = tmp_path / "caps"
    with hold(str(out), shard="1/2"):
        res = run("capture", NOWHERE, "-o", str(out), "--shard", "1/2", "--quiet", "--timeout", "5s")
        assert res.returncode == 2
        line = error_line(res)
        assert f"pid {os.getpid()}" in line and "shard 1/2" in line, line
        res = run("capture", NOWHERE, "-o", str(out), "--shard", "2/2", "--quiet", "--timeout", "5s")
        assert res.returncode == 3, res.stderr       # another shard: past the lock
        for args in (["capture", NOWHERE, "-o", str(out), "--quiet"], ["compact", str(out)]):
            res = run(*args)
            assert res.returncode == 2 and "shard 1/2" in error_line(res), res.stderr
    res = run("capture", NOWHERE, "-o", str(out), "--shard", "1/2", "--quiet", "--timeout", "5s")
    assert res.returncode == 3, res.stderr           # released
    assert not [n for n in os.listdir(out) if n.startswith(".dcptool.lock")]     # and removed by the last holder


def test_compact_beside_a_live_compact_or_capture_names_it(tmp_path):
    from dcptool.capture.lock import hold
    out = tmp_path / "caps"
    _finished_capture(out)
    with hold(str(out), command="compact"):
        res = run("capture", NOWHERE, "-o", str(out), "--resume", "--quiet")
        assert res.returncode == 2 and "compact (pid" in error_line(res), res.stderr
    with hold(str(out)):
        res = run("compact", str(out))
        assert res.returncode == 2 and f"capture (pid {os.getpid()}" in error_line(res), res.stderr


# ------------------------------------------------------------ 4: import's resync after a hole

class _Frames:
    """A sink that keeps the frames a framer cuts (their bytes) and its flagged fragments."""

    def __init__(self):
        self.got: list[bytes] = []
        self.fragments: list[tuple[int, str]] = []

    def frames(self, conn, out, buf, offsets, lengths, ts, pkts):
        self.got += [bytes(buf[o:o + n]) for o, n in zip(offsets.tolist(), lengths.tolist())]

    def fragment(self, conn, out, data, ts, why, pkt, where=0):
        self.fragments.append((len(data), why))


def _binary_frames(count: int, value: int, seed: int) -> list[bytes]:
    """DCP mutations whose values are random bytes (binary or Snappy values): full of 0x80."""
    import random
    import struct
    rng = random.Random(seed)
    out = []
    for i in range(count):
        key, extras = b"doc-%06d" % i, bytes(31)
        body = extras + key + rng.randbytes(value)
        out.append(struct.pack(">BBHBBHIIQ", 0x80, 0x57, len(key), len(extras), 0, i % 1024, len(body), 0, i) + body)
    return out


def _cut(data: bytes, hole_at: int | None, hole: int = 10) -> tuple[_Frames, object]:
    from dcptool.capture.pcap.flows import DcpFramer
    sink = _Frames()
    framer = DcpFramer(sink, 0, False, False)
    pos, mss = 0, 1448
    while pos < len(data):
        if hole_at is not None and pos <= hole_at < pos + mss:
            framer.data(data[pos:hole_at], 0, 0)
            framer.gap(hole, 0, 0)
            pos = hole_at + hole
            continue
        framer.data(data[pos:pos + mss], 0, 0)
        pos += mss
    framer.end(0, "the capture ended")
    return sink, framer


def test_after_a_hole_import_finds_the_same_frames_in_linear_work():
    """The issue's case: a 10-byte hole before ~5 MB of frames whose values hold 0x80 bytes
    (the DCP magic). The frames after the hole are the ones a capture without it gives, and
    the resync examines each byte about once (its work counter), not once per packet."""
    frames = _binary_frames(50, 100_000, seed=36)
    data = b"".join(frames)
    assert data.count(b"\x80") > 10_000
    whole, _ = _cut(data, None)
    assert whole.got == frames and whole.fragments == []
    torn, framer = _cut(data, 5_000)                 # inside the first frame's value
    assert torn.got == frames[1:]
    assert len(torn.fragments) == 2 and "10 bytes lost" in torn.fragments[1][1]
    assert sum(n for n, _ in torn.fragments) == len(frames[0]) - 10
    # bounded work: the ~100 kB searched after the hole, looked at about once each
    assert 0 < framer.resync_work <= 2 * len(frames[0]), framer.resync_work


def test_a_hole_before_a_large_value_resyncs_in_linear_work():
    """A dropped packet before 5 MB of one value's random bytes (then frames again): the bytes
    are given up as flagged fragments (RESYNC_LIMIT at a time, or up to a false header's
    claimed end), the frames after them kept."""
    big = _binary_frames(1, 5_000_000, seed=1)[0]
    after = _binary_frames(20, 1000, seed=2)
    data = big + b"".join(after)
    torn, framer = _cut(data, 100)
    assert torn.got == after
    assert sum(n for n, _ in torn.fragments) == len(big) - 10 and len(torn.fragments) >= 3
    assert framer.resync_work <= 2 * len(data), framer.resync_work
