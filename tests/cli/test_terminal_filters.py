"""Issue 39, findings 2 and 3: `stream --ops LIST --key GLOB` filter the rows of every format
(JSON lines too; `capture` records everything and takes neither), the live DCP table on a
terminal shows the stream's own rows under one header unless -v or --ops asks for the
rest, and the capture progress fits 80 and 100 columns with every label whole."""

from __future__ import annotations

import fnmatch
import io
import json
import re
import subprocess

import pytest
from rich.console import Console

from dcptool.cli.view.progress import CaptureProgress
from dcptool.live.progress import fit_items
from dcptool.protocol.dcp.server import producer as P
from tests.support import tmux_screen
from tests.support.paths import DCPTOOL
from tests.support.synapse_serve import ServeSynapse
from tests.support.threaded_server import ThreadedServer

TS_AT_START = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z ")
LABELS = ("dcp capture", "frames", "wire", "vbuckets", "written", "positions")


def _dcptool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([DCPTOOL, *args], capture_output=True, text=True, timeout=120)


def _jsonl(*args: str) -> list[dict]:
    res = _dcptool(*args)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


@pytest.fixture(scope="module")
def dcp_source():
    model = P.server_from_options(vbuckets=8, items=300, seed=4)
    with ThreadedServer(model) as srv:
        yield f"couchbase://{srv.host}:{srv.port}/default"


@pytest.mark.integration
def test_ops_and_key_filter_dcp_json_lines(dcp_source):
    every = _jsonl("stream", dcp_source)
    glob = "doc-000001*"
    want = [(r["vbucket"], r["by_seqno"], r["key"]) for r in every
            if r["op"] in ("mutation", "deletion") and r["key"] and fnmatch.fnmatchcase(r["key"], glob)]
    assert 5 < len(want) < len([r for r in every if r["op"] == "mutation"])
    got = _jsonl("stream", dcp_source, "--ops", "mutation,deletion", "--key", glob)
    assert [(r["vbucket"], r["by_seqno"], r["key"]) for r in got] == want
    assert set(got[0]) == set(every[0])          # the same keys in every line (the contract)
    ops = _jsonl("stream", dcp_source, "--ops", "stream_req,stream_end")
    assert {r["op"] for r in ops} == {"stream_req", "stream_end"}
    assert len(ops) == sum(r["op"] in ("stream_req", "stream_end") for r in every)


@pytest.mark.integration
def test_ops_and_key_filter_synapse_json_lines():
    with ServeSynapse("--items", "300", "--seed", "6") as a:
        every = _jsonl("stream", f"synapse://{a.address}", "--max-messages", "80")
    with ServeSynapse("--items", "300", "--seed", "6") as b:
        got = _jsonl("stream", f"synapse://{b.address}", "--max-messages", "80", "--ops", "rdata", "--key", "!*")
    rooms = [r["frame_no"] for r in every if r["command"] == "RDATA"
             and any(isinstance(v, str) and v.startswith("!") for v in (r["fields"] or {}).values())]
    assert rooms and [r["frame_no"] for r in got] == rooms


@pytest.mark.parametrize("args, hint", [(["--ops", "mutaton"], "mutaton"), (["--ops", ""], "--ops")])
def test_an_unknown_op_is_a_usage_error_naming_it(args, hint):
    res = _dcptool("stream", "couchbase://127.0.0.1:1/default", *args)
    assert res.returncode == 2 and hint in res.stderr and res.stdout == ""


def test_capture_records_everything_and_takes_no_filter(tmp_path):
    res = _dcptool("capture", "couchbase://127.0.0.1:1/default", "-o", str(tmp_path / "c"), "--ops", "mutation")
    assert res.returncode == 2 and "--ops" in res.stderr


@pytest.mark.integration
@pytest.mark.skipif(not tmux_screen.available(), reason="tmux is not installed")
def test_the_live_dcp_table_shows_the_stream_under_one_header(dcp_source, tmp_path):
    every = _jsonl("stream", dcp_source)
    stream_rows = [r for r in every if r["op"] in ("snapshot_marker", "mutation", "deletion", "stream_end")]
    lines, code = tmux_screen.run_on_terminal([DCPTOOL, "stream", dcp_source], width=100, tmpdir=str(tmp_path))
    assert code == 0 and max(map(len, lines)) <= 100
    heads = [ln for ln in lines if ln.split()[:2] == ["ts", "conn"]]
    assert len(heads) == 1, "\n".join(lines)
    rows = [ln for ln in lines if TS_AT_START.match(ln)]
    assert len(rows) == len(stream_rows)
    assert not any(op in ln.split() for ln in rows for op in ("stream_req", "control", "open", "hello", "noop",
                                                               "get_all_vb_seqnos", "buffer_ack"))
    # with --ops the rows asked for are shown, the handshake too
    lines, code = tmux_screen.run_on_terminal([DCPTOOL, "stream", dcp_source, "--ops", "stream_req,control"],
                                              width=100, tmpdir=str(tmp_path))
    words = {w for ln in lines for w in ln.split()}
    assert code == 0 and {"stream_req", "control", "out", "in"} <= words
    assert not words & {"mutation", "snapshot_marker", "stream_end"}


@pytest.mark.parametrize("width", [80, 100])
def test_capture_progress_fits_the_width_with_labels_whole(width):
    buf = io.StringIO()
    con = Console(file=buf, width=width, force_terminal=True, color_system=None)
    p = CaptureProgress("dcp", console=con, start=False)
    p.update(frames=112_708, wire_bytes=123_456_789, streams_open=1024, streams_ended=3,
             bytes_written=98_765_432, backlog_bytes=1_234_567, positions={vb: 100_000 + vb for vb in range(1024)},
             note="resumed 1024 vbuckets")
    con.print(p.render())
    lines = buf.getvalue().splitlines()
    assert [ln.split("  ")[0] for ln in lines] == list(LABELS), lines
    assert max(len(ln.rstrip()) for ln in lines) <= width
    assert "112,708" in lines[1] and "1,024 streaming" in lines[3]
    pos = lines[5].split()
    assert pos[-2].startswith("+") and pos[-1] == "more" and all(re.fullmatch(r"vb\d+=\d+", w) for w in pos[3:-3])


def test_fit_items_never_cuts_an_item():
    items = [f"events/master={10**i}" for i in range(12)]
    text = fit_items(items, len(items), 60)
    assert len(text) <= 60 and text.endswith("more")
    assert all(w in items for w in text.split("  ")[:-1])
    assert fit_items(items[:2], 2, 200) == "  ".join(items[:2])


@pytest.mark.integration
@pytest.mark.skipif(not tmux_screen.available(), reason="tmux is not installed")
@pytest.mark.parametrize("width", [80, 100])
def test_a_capture_on_a_terminal_shows_its_progress_labels_whole(width, tmp_path):
    # paced, so that frames with the streams' positions are drawn before the end
    model = P.server_from_options(vbuckets=64, items=3000, seed=8, scenarios=P.Scenarios(slow=0.01, slow_frames=16))
    with ThreadedServer(model) as srv:
        lines, code = tmux_screen.run_on_terminal(
            [DCPTOOL, "capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", str(tmp_path / "caps")],
            width=width, tmpdir=str(tmp_path))
    assert code == 0, "\n".join(lines)
    # the last frame drawn with every label (a frame drawn before the first stream opened has
    # no positions line yet); a cut label matches none
    whole = [i for i, ln in enumerate(lines) if ln.startswith("dcp capture")
             and [x.split("  ")[0] for x in lines[i:i + 6]] == list(LABELS)]
    assert whole, "\n".join(lines)
    frame = lines[whole[-1]:whole[-1] + 6]
    assert max(map(len, frame)) <= width and "\u2026" not in "".join(ln[:12] for ln in frame)
