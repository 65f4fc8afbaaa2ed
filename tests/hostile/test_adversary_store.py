"""The capture store under an adversary (issue 24, items 2, 4, 8, 10, 13, 15): nothing recorded
is deleted unless it was copied whole, a capture directory holds one source and protocol,
outputs never land in a capture directory and foreign files there are skipped, paths that are
not UTF-8 work, a newer capture format is refused, and a capture of many one-row segments reads
the same rows as one file.

Captures are written with the capture writer (a copy of a live writer's in-progress file
stands for the one a SIGKILLed run leaves behind); `capture` runs against 127.0.0.1:1, where
nothing listens: everything these tests look at happens before it connects (exit 3 after)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dcptool.replay.store import schema as S
from dcptool.replay.store.reader import find_captures, read_capture_table
from dcptool.replay.store.segment import finish_in_progress
from dcptool.replay.store.writer import CaptureWriter
from tests.support.cli_util import DCPTOOL, error_line, run

SOURCE = "couchbase://127.0.0.1:11210/default"
NOWHERE = "127.0.0.1:1"          # connection refused at once


def _batch(start: int, n: int) -> pa.RecordBatch:
    fn = np.arange(start, start + n, dtype=np.int64)
    return pa.RecordBatch.from_pydict({
        "frame_no": fn, "conn": np.zeros(n, np.int32),
        "ts": pa.array(fn * 1000 + 1_700_000_000_000_000_000, pa.int64()).cast(pa.timestamp("ns", tz="UTC")),
        "mono_ns": fn * 1000, "direction": pa.array(["in"] * n),
        "op": pa.array(["mutation"] * n), "vbucket": pa.array((fn % 4).astype(np.uint16)),
        "by_seqno": fn + 1, "key": pa.array([b"k%d" % i for i in fn]),
        "raw": pa.array([b"\x80\x57" + bytes(22) + b"v" * int(i % 97) for i in fn]),
    })


def _killed_capture(directory, batches: int = 6, rows: int = 347, source: str = SOURCE) -> str:
    """The in-progress file a SIGKILLed capture leaves in `directory` (`batches` IPC
    messages of `rows` rows): a copy of a live writer's file. Its path."""
    live = os.path.join(os.fspath(directory), ".live")
    w = CaptureWriter(live, "dcp", source=source, options={})
    for i in range(batches):
        w.write(_batch(i * rows, rows))
        w.flush()                                 # one IPC message per batch
    dest = os.path.join(os.fspath(directory), os.path.basename(w.in_progress))
    shutil.copy(w.in_progress, dest)
    w.close()
    shutil.rmtree(live)
    return dest


def _batch_ends(path: str) -> list[int]:
    import pyarrow.ipc as ipc
    src = pa.memory_map(path)
    r = ipc.open_stream(src)
    ends = []
    while True:
        try:
            r.read_next_batch()
        except StopIteration:
            return ends
        ends.append(src.tell())


def _jsonl(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# --------------------------------------------------------------- 2. damaged in-progress files

def _garbage_in_the_middle(tmp_path) -> tuple[str, bytes, int]:
    """A killed capture's in-progress file with garbage over its 4th batch: (path, the
    original bytes, rows in the whole batches before the garbage)."""
    cap = tmp_path / "cap"
    cap.mkdir()
    path = _killed_capture(cap)
    ends = _batch_ends(path)
    data = bytearray(open(path, "rb").read())
    at = ends[2] + 16
    data[at:at + 200] = b"\xde\xad\xbe\xef" * 50
    open(path, "wb").write(data)
    return path, bytes(data), 3 * 347


def test_verify_reports_garbage_in_an_in_progress_segment_as_damage(tmp_path):
    path, _, whole = _garbage_in_the_middle(tmp_path)
    res = run("verify", str(tmp_path / "cap"), "--format", "jsonl")
    assert res.returncode == 6, res.stderr
    damaged = [f for f in _jsonl(res.stdout) if f["check"] == "file.damaged"]
    assert len(damaged) == 1 and damaged[0]["severity"] == "error", res.stdout[:2000]
    msg = damaged[0]["message"]
    assert f"{whole:,} rows" in msg and "bytes after byte" in msg, msg
    assert _jsonl(res.stdout)[0]["check"] == "file.damaged"       # damage first


def test_resume_keeps_a_damaged_in_progress_file_and_every_whole_batch_before_it(tmp_path):
    path, original, whole = _garbage_in_the_middle(tmp_path)
    cap = tmp_path / "cap"
    res = run("capture", f"couchbase://{NOWHERE}/default", "-o", str(cap), "--resume", "--quiet",
              "--timeout", "5s")
    assert res.returncode == 3, res.stderr             # recovered first, then the connection failed
    assert "Traceback" not in res.stderr
    parquet = path[:-len(".arrows")] + ".parquet"
    t = pq.read_table(parquet)
    assert t.num_rows == whole and t["frame_no"].to_pylist() == list(range(whole))
    # the damaged file is kept, byte for byte, next to it; nothing is deleted
    assert not os.path.exists(path)
    assert open(path + ".damaged", "rb").read() == original
    warn = [ln for ln in res.stderr.splitlines() if "could not be read" in ln]
    assert warn and f"recovered {whole:,} rows in 3 whole batches" in warn[0], res.stderr
    # verify keeps saying so (error, exit 6), and replay reads the recovered rows
    res = run("verify", str(cap), "--format", "jsonl")
    assert res.returncode == 6
    damaged = [f for f in _jsonl(res.stdout) if f["check"] == "file.damaged"]
    assert damaged and damaged[0]["file"].endswith(".arrows.damaged"), res.stdout[:2000]
    assert f"{whole:,} rows in 3 whole batches readable" in damaged[0]["message"]
    res = run("inspect", str(cap), "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["rows"] == whole, res.stderr
    assert "kept aside" in res.stderr


@pytest.mark.parametrize("cut", [0.5, 0.05])
def test_a_torn_in_progress_file_is_truncated_to_its_whole_batches(tmp_path, cut):
    """A file cut short (also inside its first batch: nothing whole to recover) is a torn
    tail, the end of a log (issue 36, 12): recovery writes the whole batches and removes the
    file, with a note of information; nothing is kept aside as damaged."""
    path = _killed_capture(tmp_path)
    data = open(path, "rb").read()
    torn = data[:int(len(data) * cut)]
    open(path, "wb").write(torn)
    whole = sum(1 for end in _batch_ends_of(torn) if end <= len(torn)) * 347
    info = finish_in_progress(path)
    assert info is not None and info["damaged"] is None and info["torn"] > 0
    assert "torn tail" in info["note"] and not os.path.exists(path)
    assert not [n for n in os.listdir(tmp_path) if ".damaged" in n]
    assert info["rows"] == whole
    if whole:
        assert pq.read_table(info["path"]).num_rows == whole
    else:
        assert info["path"] is None and not os.path.exists(path[:-len(".arrows")] + ".parquet")


def _batch_ends_of(data: bytes) -> list[int]:
    import pyarrow.ipc as ipc
    src = pa.BufferReader(data)
    ends = []
    try:
        r = ipc.open_stream(src)
        while True:
            r.read_next_batch()
            ends.append(src.tell())
    except (StopIteration, pa.ArrowException, OSError, EOFError):
        return ends


def test_a_clean_in_progress_file_is_still_finished_and_removed(tmp_path):
    path = _killed_capture(tmp_path, batches=2, rows=10)
    info = finish_in_progress(path)
    assert info["rows"] == 20 and info["damaged"] is None and not os.path.exists(path)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(info["path"])]


# --------------------------------------------------------------- 4. one source per directory

def _finished_capture(directory, source=SOURCE, protocol="dcp", rows=20) -> None:
    from tests.bench.bench_segments import rows as clean_rows
    w = CaptureWriter(directory, protocol, source=source, options={})
    if protocol == "dcp":
        w.write(clean_rows(rows))         # protocol-clean: verify finds nothing in it
    else:
        w.write(pa.RecordBatch.from_pydict({"frame_no": pa.array(range(rows), pa.int64()),
                                            "command": pa.array(["PING"] * rows),
                                            "raw": pa.array([b"PING"] * rows)}))
    w.close()


def test_resume_of_another_bucket_is_a_usage_error_naming_both(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPTOOL_PASSWORD", "secret-pw")
    cap = tmp_path / "cap"
    _finished_capture(cap)
    before = sorted(os.listdir(cap))
    res = run("capture", f"couchbase://admin@{NOWHERE}/other", "-o", str(cap), "--resume", "--quiet")
    assert res.returncode == 2, res.stderr
    line = error_line(res)
    assert "127.0.0.1:11210/default" in line and f"{NOWHERE}/other" in line, line
    assert "admin" not in line and "secret-pw" not in res.stderr
    assert sorted(os.listdir(cap)) == before


def test_a_second_capture_of_another_source_needs_force_new(tmp_path, monkeypatch):
    monkeypatch.setenv("DCPTOOL_PASSWORD", "secret-pw")
    cap = tmp_path / "cap"
    _finished_capture(cap)
    res = run("capture", f"couchbase://{NOWHERE}/other", "-o", str(cap), "--quiet")
    assert res.returncode == 2 and "--force-new" in error_line(res)
    res = run("capture", f"couchbase://{NOWHERE}/other", "-o", str(cap), "--quiet", "--force-new")
    assert res.returncode == 3, res.stderr           # past the check: the connection is refused
    # the same source (another seed port, another user) is not another source
    res = run("capture", f"couchbase://bob@{NOWHERE}/default", "-o", str(cap), "--quiet", "--resume")
    assert res.returncode == 3, res.stderr
    res = run("capture", f"couchbase://{NOWHERE}/other", "-o", str(cap), "--resume", "--force-new")
    assert res.returncode == 2


@pytest.mark.parametrize("force", [[], ["--force-new"]])
def test_another_protocol_in_a_capture_directory_is_refused(tmp_path, force):
    syn, dcp = tmp_path / "syn", tmp_path / "dcp"
    _finished_capture(syn, source="synapse://127.0.0.1:9092", protocol="synapse")
    _finished_capture(dcp)
    res = run("capture", f"couchbase://{NOWHERE}/default", "-o", str(syn), "--quiet", *force)
    assert res.returncode == 2 and "one protocol" in error_line(res)
    res = run("capture", f"synapse://{NOWHERE}", "-o", str(dcp), "--quiet", "--resume")
    assert res.returncode == 2 and "one protocol" in error_line(res)


def test_verify_flags_a_directory_holding_two_sources(tmp_path):
    cap = tmp_path / "cap"
    _finished_capture(cap)
    _finished_capture(cap, source="couchbase://127.0.0.1:11210/other")
    res = run("verify", str(cap), "--format", "jsonl")
    assert res.returncode == 6
    mixed = [f for f in _jsonl(res.stdout) if f["check"] == "file.mixed_sources"]
    assert len(mixed) == 1 and mixed[0]["severity"] == "error", res.stdout[:2000]


# --------------------------------------------------------------- 8. outputs and foreign files

def test_replay_output_into_the_capture_directory_is_a_usage_error(tmp_path):
    cap = tmp_path / "cap"
    _finished_capture(cap)
    before = sorted(os.listdir(cap))
    for args in (["-o", str(cap)], ["-o", str(cap / ".")], ["--output", str(cap)]):
        res = run("replay", str(cap), "--table", "documents", *args)
        assert res.returncode == 2, res.stderr
        assert "capture directory" in res.stderr and "Traceback" not in res.stderr
        assert sorted(os.listdir(cap)) == before
    # another capture directory is one too; a new directory is fine
    other = tmp_path / "other"
    _finished_capture(other)
    assert run("replay", str(cap), "-o", str(other)).returncode == 2
    res = run("replay", str(cap), "--table", "documents", "-o", str(tmp_path / "out"))
    assert res.returncode == 0 and os.listdir(tmp_path / "out") == ["documents.parquet"], res.stderr


def test_foreign_parquet_in_a_capture_directory_is_skipped_with_a_warning(tmp_path):
    cap = tmp_path / "cap"
    _finished_capture(cap)
    pq.write_table(pa.table({"key": ["a"], "value": [1]}), cap / "documents.parquet")
    (cap / "notes.parquet").write_bytes(b"not parquet at all")
    want = run("replay", str(cap), "--checksum")
    for cmd in (["inspect", "--json"], ["replay", "--checksum"], ["verify", "--format", "jsonl"]):
        res = run(cmd[0], str(cap), *cmd[1:])
        assert res.returncode == 0, (cmd, res.stderr)
        warnings = [ln for ln in res.stderr.splitlines() if ln.startswith("dcptool: warning:")]
        assert len(warnings) == 2 and all("skipped" in w for w in warnings), res.stderr
    assert want.returncode == 0
    # a file named by the user is still an error, not skipped
    assert run("inspect", str(cap / "documents.parquet")).returncode == 1


# --------------------------------------------------------------- 10. paths that are not UTF-8

# under a C locale Python 3.7+ turns on its UTF-8 mode by itself; PYTHONUTF8=0 is the C locale proper
# (ASCII file names: a non-ASCII name arrives surrogate-escaped)
@pytest.mark.parametrize("name,env", [(b"caps-\xff\xfe", {}), ("caps-\u00e9t\u00e9".encode(), {"LC_ALL": "C", "PYTHONUTF8": "0"})])
def test_paths_that_are_not_utf8_or_not_ascii_under_a_c_locale(tmp_path, name, env):
    from dcptool.protocol.dcp.server import producer as P
    from tests.support.threaded_server import ThreadedServer
    cap = os.path.join(os.fsencode(tmp_path), name)
    model = P.server_from_options(vbuckets=4, items=200, seed=3)
    environ = dict(os.environ, **env)

    def dcptool(*args):
        return subprocess.run([os.fsencode(DCPTOOL), *args], capture_output=True, timeout=120, env=environ)

    with ThreadedServer(model) as srv:
        res = dcptool("capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", cap, "--quiet")
    assert res.returncode == 0, res.stderr
    names = os.listdir(cap)
    assert names and all(n.endswith(b".parquet") for n in names), names
    for args in (["inspect", cap, "--json"], ["verify", cap, "--format", "jsonl"], ["replay", cap, "--checksum"]):
        res = dcptool(*args)
        assert res.returncode == 0, (args, res.stderr)
        assert b"surrogates" not in res.stderr and b"Traceback" not in res.stderr
    summary = json.loads(dcptool("inspect", cap, "--json").stdout)
    assert summary["rows"] > 200
    # the library takes the surrogate-escaped str of such a name
    files = find_captures([os.fsdecode(cap)])
    assert read_capture_table(files).num_rows == summary["rows"]


def test_writer_and_recovery_in_a_directory_that_is_not_utf8(tmp_path):
    d = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"x\xff"))
    path = _killed_capture(d, batches=2, rows=10)
    info = finish_in_progress(path)
    assert info["rows"] == 20 and os.path.exists(info["path"])
    assert read_capture_table(find_captures([d])).num_rows == 20


# --------------------------------------------------------------- 13. a newer capture format

def test_a_newer_capture_format_is_refused(tmp_path):
    cap = tmp_path / "cap"
    _finished_capture(cap)
    [name] = os.listdir(cap)
    _finished_capture(cap)               # a second capture, readable
    t = pq.read_table(cap / name)
    meta = {**t.schema.metadata, S.META_FORMAT.encode(): b"3"}
    pq.write_table(t.replace_schema_metadata(meta), cap / name)
    for cmd in (["inspect"], ["replay", "--checksum"]):
        res = run(cmd[0], str(cap), *cmd[1:])
        assert res.returncode == 2, (cmd, res.stderr)
        line = error_line(res)
        assert name in line and "'3'" in line, line
    res = run("verify", str(cap), "--format", "jsonl")
    assert res.returncode == 6
    [f] = [f for f in _jsonl(res.stdout) if f["check"] == "file.unsupported_format"]
    assert f["severity"] == "error" and name in f["file"]


# --------------------------------------------------------------- 15. many small segments

def test_many_one_row_segments_read_the_same_rows_as_one_file_before_and_after_compact(tmp_path):
    """500 one-row segments (the bench measures 5,000; the paths are the same): inspect,
    replay and verify agree with one file of the same rows, and again after `dcptool compact`
    merged them (replay/store/compact.py). The commands on the many segments run with at most
    FEW_FILES open file descriptors: a command that held every segment open at once would fail
    here as it would on 5,000 segments under the usual limit of 1,024."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.bench.bench_segments import rows, write_capture
    n = 500
    t = rows(n)
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    write_capture(one, t, n)
    write_capture(many, t, 1)
    assert len(os.listdir(many)) == n
    a = {"inspect": run("inspect", one, "--json"), "replay": run("replay", one, "--checksum"),
         "verify": run("verify", one, "--format", "jsonl")}       # one file: the same both times
    assert all(r.returncode == 0 for r in a.values()), a
    sa = json.loads(a["inspect"].stdout)
    assert len(sa.pop("files")) == 1 and [c.pop("segments") for c in sa["captures"]] == [1]
    for segments in (n, 1):
        b = few_files("inspect", many, "--json")
        assert b.returncode == 0, b.stderr
        sb = json.loads(b.stdout)
        assert len(sb.pop("files")) == segments
        assert [c.pop("segments") for c in sb["captures"]] == [segments]
        assert sa == sb and sb["rows"] == n
        b = few_files("replay", many, "--checksum")
        assert a["replay"].stdout == b.stdout and b.returncode == 0, b.stderr
        b = few_files("verify", many, "--format", "jsonl")
        assert b.returncode == 0, b.stdout[:2000]
        assert f"verified {n:,} rows in {segments} file(s)" in b.stderr
        if segments == n:
            c = few_files("compact", many)
            assert c.returncode == 0, c.stderr
            assert len(os.listdir(many)) == 1


FEW_FILES = 256      # open file descriptors of the commands on many segments (below the 500 segments)


def few_files(*args) -> subprocess.CompletedProcess:
    """`dcptool ARGS` with a soft limit of FEW_FILES open files."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (FEW_FILES, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return subprocess.run([DCPTOOL, *args], capture_output=True, text=True, timeout=120, preexec_fn=limit)


def test_findings_in_a_run_of_small_segments_name_the_segment_of_their_frame(tmp_path):
    """Small segments are verified as one chunk; a finding still names the file it is in, as
    when they are verified file by file."""
    from dcptool.replay.check import verify as V
    from tests.bench.bench_segments import rows, write_capture
    t = rows(100)
    fn = t["frame_no"].to_numpy().copy()
    fn[60:] += 1                                     # frame 60 lost: a hole in segment 60
    seq = t["by_seqno"].to_pylist()
    seq[80] = seq[79]                                # and a seqno that does not increase
    t = t.set_column(1, "frame_no", pa.array(fn)).set_column(
        t.schema.get_field_index("by_seqno"), "by_seqno", pa.array(seq, pa.int64()))
    write_capture(str(tmp_path), t, 1)
    report = V.verify([str(tmp_path)])
    got = {f.check: (f.segment, f.frame_no) for f in report.findings}
    assert got == {"file.frames_missing": (60, 60), "dcp.seqno_not_increasing": (80, 81)}, got


def test_each_small_segment_is_parsed_and_read_once_per_command(tmp_path):
    """inspect, verify and replay of 120 one-row segments parse each footer once and read each
    file once (the cost of many small segments is per file: a second pass over the files, as
    the cluster-config pass of inspect and replay, reads them from the run read already), and
    give what one file of the same rows gives."""
    from dcptool.replay.check import summary
    from dcptool.replay.check import verify as V
    from dcptool.replay.local import engine as local
    from dcptool.replay.store import footers, reader
    from tests.bench.bench_segments import rows, write_capture
    n = 120
    t = rows(n)
    one, many = str(tmp_path / "one"), str(tmp_path / "many")
    write_capture(one, t, n)
    write_capture(many, t, 1)

    def counted(command, where):
        footers.forget()
        reader.RUN_CACHE.clear()
        parsed, scans = footers.PARSED[0], len(reader.SCANS)
        result = command(where)
        return result, footers.PARSED[0] - parsed, sum(reader.SCANS[scans:])

    def replay(where):                 # as `dcptool replay` does: every table but frames
        rep = local.replay_local(reader.find_captures([where]))
        return {name: rep.table(name) for name in rep.names() if name != "frames"}

    commands = {"inspect": lambda where: summary.summarize([where]), "verify": lambda where: V.verify([where]),
                "replay": replay}
    for name, command in commands.items():
        (a, _, _), (b, parsed, read) = counted(command, one), counted(command, many)
        assert (parsed, read) == (n, n), name
        if name == "inspect":
            assert len(a.pop("files")) == 1 and len(b.pop("files")) == n
            assert [c.pop("segments") for c in a["captures"] + b["captures"]] == [1, n]
        elif name == "verify":
            a, b = (a.findings, a.rows, a.counts), (b.findings, b.rows, b.counts)
        else:
            a = {k: v.to_pylist() for k, v in a.items()}
            b = {k: v.to_pylist() for k, v in b.items()}
        assert a == b and (b["documents"] if name == "replay" else True), name
