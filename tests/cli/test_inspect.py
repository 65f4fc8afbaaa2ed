"""`dcptool inspect` and the capture progress display / summary printer."""

from __future__ import annotations

import io
import json
import shutil

from click.testing import CliRunner
from rich.console import Console

from dcptool.cli import cli
from dcptool.cli.view.progress import (
    CaptureProgress,
    NullProgress,
    make_progress,
    print_summary,
)
from tests.support.capture_rows import Rec

T0 = 1_700_000_000_000_000_000


def run(*args, input=None):
    res = CliRunner().invoke(cli, list(args), input=input)
    return res.exit_code, res.stdout, res.stderr


def dcp_capture(directory, rotate_size=3_000):
    r = Rec(directory, rotate_size=rotate_size)
    r.stream_ok(0, [(111, 0)])
    r.stream_ok(1, [(222, 0)])
    r.marker(0, 0, 10)
    r.items(0, 1, 10)
    r.marker(1, 0, 3)
    r.items(1, 1, 2)
    r.items(1, 3, 3, op="deletion")
    r.add(op="noop")
    r.add(op="noop", direction="out", status=0)
    r.marker(0, 11, 20)
    r.items(0, 11, 14)
    r.add(op="stream_end", vbucket=1, stream_end_reason=0)
    r.add(op="stream_req", vbucket=2, status=0x23, rollback_seqno=7)
    r.add(op="unknown_0xee", decode_error="unknown opcode 0xee", raw=b"\x80\xee")
    for i, row in enumerate(r.rows):
        row["ts"] = T0 + i * 1_000_000
    rows, r.rows = r.rows, []
    for i in range(0, len(rows), 5):      # several batches, so that segments rotate
        r.rows = rows[i:i + 5]
        r.flush()
    return r


def test_inspect_dcp_json(tmp_path):
    r = dcp_capture(tmp_path)
    segs = r.close()
    assert len(segs) > 1
    code, out, err = run("inspect", str(tmp_path), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["protocol"] == "dcp"
    assert [f["segment"] for f in s["files"]] == list(range(len(segs)))
    assert sum(f["rows"] for f in s["files"]) == s["rows"] == r.n
    assert s["time_span"]["first"] == "2023-11-14T22:13:20.000000000Z"
    assert s["time_span"]["seconds"] == (r.n - 1) / 1000
    assert s["directions"] == {"in": r.n - 3, "out": 3}
    assert s["ops"]["mutation"] == 16 and s["ops"]["deletion"] == 1
    assert s["ops"]["snapshot_marker"] == 3 and s["ops"]["stream_req"] == 5
    vb = {v["vbucket"]: v for v in s["vbuckets"]}
    assert (vb[0]["first_seqno"], vb[0]["last_seqno"], vb[0]["items"], vb[0]["snapshots"]) == (1, 14, 14, 2)
    assert (vb[1]["first_seqno"], vb[1]["last_seqno"], vb[1]["stream_end_reason"]) == (1, 3, 0)
    assert vb[2]["rollbacks"] == 1 and vb[2]["items"] == 0
    assert s["snapshots"] == 3
    assert [(x["vbucket"], x["rollback_seqno"]) for x in s["rollbacks"]] == [(2, 7)]
    assert [(x["vbucket"], x["reason"], x["reason_name"]) for x in s["stream_ends"]] == [(1, 0, "ok")]
    assert s["decode_errors"]["count"] == 1
    assert s["decode_errors"]["examples"][0]["error"] == "unknown opcode 0xee"


def test_inspect_reads_in_progress_segments(tmp_path):
    r = dcp_capture(tmp_path / "live")
    r.add(op="noop", ts=T0 + 10**9)        # opens a fresh segment that stays in progress
    r.flush()
    r.w.flush()
    dead = tmp_path / "dead"
    dead.mkdir()
    for p in (tmp_path / "live").iterdir():
        shutil.copy(p, dead)
    r.close()
    code, out, err = run("inspect", str(dead), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["rows"] == r.n
    assert [f["in_progress"] for f in s["files"]] == [False] * (len(s["files"]) - 1) + [True]
    # one in-progress file named directly works too
    arrows = [f["path"] for f in s["files"] if f["in_progress"]]
    code, out, err = run("inspect", arrows[0], "--json")
    assert code == 0 and json.loads(out)["files"][0]["in_progress"] is True


def test_inspect_human_output(tmp_path):
    dcp_capture(tmp_path).close()
    code, out, err = run("inspect", str(tmp_path), "--format", "table")
    assert code == 0, err
    for text in ("files", "rows per op", "mutation", "vbuckets", "rollbacks", "stream ends",
                 "0 (ok)", "decode errors", "unknown opcode 0xee"):
        assert text in out
    assert err == ""


def test_inspect_paths_from_stdin(tmp_path):
    segs = dcp_capture(tmp_path).close()
    code, out, err = run("inspect", "-", "--json", input="\n".join(s["path"] for s in segs) + "\n")
    assert code == 0, err
    assert len(json.loads(out)["files"]) == len(segs)


def test_inspect_synapse_positions_gaps_and_dropped(tmp_path):
    r = Rec(tmp_path, protocol="synapse")
    r.add(command="SERVER", args="hs1")
    r.add(command="POSITION", stream="events", instance="master", prev_token=0, new_token=10)
    r.add(command="RDATA", stream="events", instance="master", token=11, row="[]")
    r.add(command="RDATA", stream="events", instance="master", batch=True, row="[]")
    r.add(command="RDATA", stream="events", instance="master", token=12, row="[]")
    r.add(command="POSITION", stream="events", instance="master", prev_token=15, new_token=16)
    r.add(command="RDATA", stream="caches", instance="w1", batch=True, row="[]")
    r.add(command="PING", args="1", conn=1)            # reconnect: the waiting row is dropped
    r.add(command="REPLICATE", direction="out", conn=1)
    r.close()
    code, out, err = run("inspect", str(tmp_path), "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["commands"] == {"RDATA": 4, "POSITION": 2, "PING": 1, "REPLICATE": 1, "SERVER": 1}
    pos = {(p["stream"], p["instance"]): p for p in s["positions"]}
    ev = pos[("events", "master")]
    assert (ev["token"], ev["rows"], ev["batches"], ev["positions"], ev["gaps"]) == (16, 3, 1, 2, 1)
    assert pos[("caches", "w1")]["dropped"] == 1 and pos[("caches", "w1")]["waiting"] == 0
    assert [(g["from_token"], g["to_token"]) for g in s["gaps"]] == [(12, 15)]
    code, out, err = run("inspect", str(tmp_path), "--format", "table")
    assert code == 0 and "positions" in out and "gaps" in out


def test_inspect_errors_are_one_line_exit_1(tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    for args in ([str(bad)], [str(tmp_path / "missing")], []):
        if not args:
            empty = tmp_path / "empty"
            empty.mkdir()
            args = [str(empty)]
        code, out, err = run("inspect", *args)
        assert code == 1, (args, out, err)
        assert out == ""
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --------------------------------------------------------------------- progress display

class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_progress_renders_rates_streams_and_positions():
    clock = Clock()
    p = CaptureProgress("dcp", console=Console(file=io.StringIO()), clock=clock, start=False)
    positions = {}
    p.update(positions=positions, streams_open=3, streams_ended=1)
    p.render()
    clock.t += 2.0
    p.add(frames=20_000, wire_bytes=4_000_000)
    positions.update({vb: vb * 10 for vb in range(12)})
    p.update(bytes_written=3 * 2**20, backlog_bytes=2**20)
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=False).print(p.render())
    text = buf.getvalue()
    assert "20,000  (10,000/s)" in text
    assert "2.00 MB/s" in text
    assert "3 streaming, 1 ended" in text
    assert "3.0 MiB" in text and "backlog 1.0 MiB" in text
    assert "vb0=0" in text and "vb7=70" in text and "+4 more" in text
    assert "0:00:02" in text
    p.close()


def test_progress_synapse_tokens_and_live_start_stop():
    buf = io.StringIO()
    con = Console(file=buf, width=200, force_terminal=True)
    with CaptureProgress("synapse", console=con) as p:
        p.update(frames=5, positions={"events/master": 42}, streams_open=2)
    assert "events/master=42" in buf.getvalue()


def test_make_progress_is_a_no_op_when_quiet_or_not_a_terminal():
    assert isinstance(make_progress("dcp", quiet=True, console=Console(file=io.StringIO(), force_terminal=True)), NullProgress)
    p = make_progress("dcp", console=Console(file=io.StringIO(), force_terminal=False))
    assert type(p) is NullProgress and not p.enabled
    p.update(frames=1)
    p.add(1, 2)
    p.close()


def test_print_summary_json_and_table():
    files = [{"path": "a.parquet", "rows": 10, "bytes": 2048}, {"path": "b.parquet", "rows": 5, "bytes": 1024}]
    out, err = io.StringIO(), io.StringIO()
    s = print_summary(files, json_summary=True, quiet=True, extra={"capture_id": "abc"},
                      console=Console(file=err), stdout=out)
    assert json.loads(out.getvalue()) == s == {"files": files, "rows": 15, "bytes": 3072, "capture_id": "abc"}
    assert err.getvalue() == ""
    out, err = io.StringIO(), io.StringIO()
    print_summary(files, extra={"capture_id": "abc"}, console=Console(file=err, width=120), stdout=out)
    assert out.getvalue() == ""
    text = err.getvalue()
    assert "a.parquet" in text and "15" in text and "3.0 KiB" in text and "capture_id: abc" in text
