"""The output contract (docs/CLI.md): one timestamp format, keys as text (key_base64 when not
UTF-8), JSON values as JSON, other values as value_base64, broken Snappy flagged, control
characters from the other side escaped in tables and text, tables never cut in a pipe."""

from __future__ import annotations

import base64
import io
import json
import re

import cramjam
import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.cli.view.output import Sink, iso_ns, printable
from dcptool.live.table import MARK, TextTable
from dcptool.protocol.dcp.wire import messages as M
from dcptool.replay.display import dcp_display, value_fields

TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")
ESC = "\x1b"

SNAPPY_JSON = bytes(cramjam.snappy.compress_raw(b'{"b":[1,2],"s":"x"}'))
SNAPPY_BIN = bytes(cramjam.snappy.compress_raw(b"\x00\x01binary"))
# (key, datatype, value)
DOCS = [
    (b"doc-1", 1, b'{"a":1}'),                 # JSON
    (b"\xff\xfekey", 0, b"\x00\x01\x02"),      # a key that is not UTF-8, a binary value
    (b"snap", 3, SNAPPY_JSON),                  # Snappy + JSON
    (b"broken", 3, b"\x05garbage"),             # Snappy that does not decompress
    (b"red\x1b[31mkey", 1, b'{"t":"\\u001b[2J"}'),  # ESC in a key (valid UTF-8) and in a value
    (b"snapbin", 2, SNAPPY_BIN),                # Snappy, not JSON
    (b"notjson", 1, b"{oops"),                  # JSON datatype, not JSON
]


def _frames() -> bytes:
    return b"".join(M.encode(M.Mutation(vbucket=3, opaque=1, cas=7, datatype=dt, key=k, value=v,
                                        by_seqno=i + 1, rev_seqno=1))
                    for i, (k, dt, v) in enumerate(DOCS))


def _runner():
    kw = {"mix_stderr": False} if "mix_stderr" in CliRunner.__init__.__code__.co_varnames else {}
    return CliRunner(**kw)


def _check_items(rows: list[dict]) -> None:
    by_seq = {r["by_seqno"]: r for r in rows if r["op"] == "mutation"}
    assert len(by_seq) == len(DOCS)
    for r in by_seq.values():  # the columns are always there
        for c in ("key", "key_base64", "value", "value_base64", "value_error"):
            assert c in r, c
    assert by_seq[1]["key"] == "doc-1" and by_seq[1]["key_base64"] is None
    assert by_seq[1]["value"] == {"a": 1} and by_seq[1]["value_base64"] is None
    assert by_seq[2]["key"] is None and base64.b64decode(by_seq[2]["key_base64"]) == b"\xff\xfekey"
    assert by_seq[2]["value"] is None and base64.b64decode(by_seq[2]["value_base64"]) == b"\x00\x01\x02"
    assert by_seq[3]["value"] == {"b": [1, 2], "s": "x"} and by_seq[3]["value_error"] is None
    assert by_seq[4]["value"] is None and base64.b64decode(by_seq[4]["value_base64"]) == b"\x05garbage"
    assert by_seq[4]["value_error"].startswith("snappy")
    assert by_seq[5]["key"] == "red\x1b[31mkey" and by_seq[5]["value"] == {"t": "\x1b[2J"}
    assert base64.b64decode(by_seq[6]["value_base64"]) == b"\x00\x01binary" and by_seq[6]["value_error"] is None
    assert by_seq[7]["value"] is None and base64.b64decode(by_seq[7]["value_base64"]) == b"{oops"
    assert "JSON" in by_seq[7]["value_error"]


# ------------------------------------------------------------------ the helpers

def test_iso_ns_is_rfc3339_utc_with_nine_digits():
    assert iso_ns(None) is None
    assert iso_ns(0) == "1970-01-01T00:00:00.000000000Z"
    assert iso_ns(1_700_000_000_123_456_789) == "2023-11-14T22:13:20.123456789Z"
    assert iso_ns(1_700_000_000_000_000_000) == "2023-11-14T22:13:20.000000000Z"
    assert iso_ns(1_700_000_001_000_001_000) == "2023-11-14T22:13:21.000001000Z"
    assert iso_ns(-1) == "1969-12-31T23:59:59.999999999Z"
    for ns in (1, 10**18, 1_763_800_000_999_999_999):
        assert TS.match(iso_ns(ns)), iso_ns(ns)
    # no fake date for a value no calendar holds (a hostile capture)
    assert iso_ns(2**63 - 1) == "2262-04-11T23:47:16.854775807Z"  # the largest int64
    assert iso_ns(10**30) == f"{10**30}ns"


def test_printable_escapes_controls_and_keeps_text():
    assert printable("doc-1 é 文字 ok") == "doc-1 é 文字 ok"
    assert printable("a\x1b[31mb") == "a\\x1b[31mb"
    assert printable("x\x00\x07\x7f\x9b\ny\u202e") == "x\\x00\\x07\\x7f\\x9b\\x0ay\\u202e"
    assert ESC not in printable(ESC * 3)


def test_value_fields_rules():
    assert value_fields(b'{"a":1}', 1) == ({"a": 1}, None, None)
    assert value_fields(b"\x01", 0) == (None, "AQ==", None)
    assert value_fields(SNAPPY_JSON, 3)[0] == {"b": [1, 2], "s": "x"}
    v, b64, err = value_fields(b"\x05garbage", 3)
    assert v is None and base64.b64decode(b64) == b"\x05garbage" and err.startswith("snappy")
    # a length header over the largest item is refused before anything is allocated
    v, b64, err = value_fields(b"\xff\xff\xff\xff\x0f" + b"\x00" * 8, 2)
    assert v is None and "over" in err
    # xattrs: the value is not a bare JSON document
    assert value_fields(b'{"a":1}', 5) == (None, base64.b64encode(b'{"a":1}').decode(), None)
    assert value_fields(b"[" * 5000 + b"]" * 5000, 1)[0] is None  # too deep: base64, never a crash


def test_dcp_display_keeps_text_and_fills_columns():
    row = dcp_display({"key": b"k", "value": None, "datatype": 1})
    assert row == {"key": "k", "key_base64": None, "value": None, "value_base64": None, "value_error": None,
                   "datatype": 1}
    assert dcp_display({"op": "noop"}) == {"op": "noop"}


# ------------------------------------------------------------------ decode

def test_decode_jsonl_keys_and_values():
    res = _runner().invoke(cli, ["decode", "--values", "--format", "jsonl", "-"], input=_frames())
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    _check_items(rows)
    assert len({tuple(r) for r in rows}) == 1  # every row carries every column


def test_decode_without_values_has_no_value_columns_but_key_base64():
    res = _runner().invoke(cli, ["decode", "--format", "jsonl", "-"], input=_frames())
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert all("value" not in r and "key_base64" in r for r in rows)


@pytest.mark.parametrize("fmt", ["table", "text"])
def test_decode_table_and_text_show_values_and_escape(fmt):
    res = _runner().invoke(cli, ["decode", "--values", "--format", fmt, "-"], input=_frames())
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert ESC not in out and ESC not in res.stderr
    assert "red\\x1b[31mkey" in out and '{"t":"\\u001b[2J"}' in out  # JSON escapes its own
    assert '{"a":1}' in out and '{"b":[1,2],"s":"x"}' in out
    assert base64.b64encode(b"\xff\xfekey").decode() in out and "snappy" in out
    if fmt == "table":
        head = out.splitlines()[0].split()
        assert head[:2] == ["op", "magic"] and "value" in head and "value_error" in head


def test_table_in_a_pipe_is_never_cut():
    long_key = b"k" * 150
    data = M.encode(M.Mutation(vbucket=3, opaque=1, cas=7, datatype=1, key=long_key,
                               value=b'{"v":"' + b"x" * 200 + b'"}', by_seqno=1, rev_seqno=1))
    res = _runner().invoke(cli, ["decode", "--values", "--format", "table", "-"], input=data)
    assert res.exit_code == 0
    line = next(x for x in res.stdout.splitlines() if "mutation" in x)
    assert len(line) > 350 and "k" * 150 in line and "x" * 200 in line
    assert "…" not in res.stdout and "..." not in res.stdout


# ------------------------------------------------------------------ stream

@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["jsonl", "table"])
def test_stream_keys_values_and_escapes(fmt):
    from dcptool.protocol.dcp.server import producer as P
    from tests.support.threaded_server import ThreadedServer

    model = P.server_from_options(vbuckets=1, items=0, seed=1)
    vb = model.buckets["default"].vbuckets[0]
    for k, dt, v in DOCS:
        vb.append(k, v, "m", 0x1800_0000_0000_0001 + vb.high_seqno).datatype = dt
    with ThreadedServer(model) as srv:
        res = _runner().invoke(cli, ["stream", f"couchbase://{srv.host}:{srv.port}/default", "--values",
                                     "--format", fmt], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    assert ESC not in res.stderr
    if fmt == "jsonl":
        rows = [json.loads(line) for line in res.stdout.splitlines()]
        _check_items(rows)
        assert all(TS.match(r["ts"]) for r in rows)
    else:
        out = res.stdout
        assert ESC not in out
        assert "doc-1" in out and "red\\x1b[31mkey" in out and '{"b":[1,2],"s":"x"}' in out
        assert base64.b64encode(b"\xff\xfekey").decode() in out
        # a header again whenever a column first gets a value (`ts` first: no width limit)
        heads = [line.split() for line in out.splitlines() if line.split()[:3] == ["ts", "conn", "direction"]]
        assert {"key", "key_base64", "value", "value_base64", "value_error"} <= set(heads[-1])


# ------------------------------------------------------------------ tables

SYN_COLUMNS = ["frame_no", "conn", "direction", "command", "stream", "instance", "token", "detail"]


def _synapse_rows():
    a = "org.matrix.msc4242.very_long_stream_name_for_presence_alpha"
    b = "org.matrix.msc4242.very_long_stream_name_for_presence_beta"
    rows = [{"frame_no": i, "conn": 1, "direction": "in", "command": "RDATA", "stream": s, "instance": "master",
             "token": 100 + i, "detail": "user_id=@" + "u" * 80 + ":example.org state=online"}
            for i, s in enumerate([a, b, a])]
    rows.append({"frame_no": 3, "conn": 1, "direction": "in", "command": "ERROR", "stream": "ev\x1b]0;pwn\x07",
                 "instance": None, "token": None, "detail": "[bold]x\x1b[2J"})
    return a, b, rows


def test_synapse_stream_names_stay_whole_and_distinct_on_a_terminal():
    a, b, rows = _synapse_rows()
    out = io.StringIO()
    table = TextTable(out, SYN_COLUMNS, title="stream", width=140)
    table.write(rows)
    text = out.getvalue()
    assert ESC not in text.replace("\x1b[1m", "").replace("\x1b[0m", "")  # only our bold header
    assert text.count(a) == 2 and text.count(b) == 1  # whole, never folded or cut
    assert "ev\\x1b]0;pwn\\x07" in text
    # the long detail wraps only between words (issue 39): its 101-character user id, too
    # wide for the room the whole columns leave, goes whole on an indented line of its own
    user = "user_id=@" + "u" * 80 + ":example.org"
    lines = text.splitlines()
    assert sum(ln.strip() == user + " state=online" for ln in lines) == 3 and "[bold]x\\x1b[2J" in text
    assert max(len(line) for line in lines[2:]) <= 140
    # a terminal too narrow for the whole columns on one line: a row goes on over indented
    # lines of whole columns (CLI.md), none wider than the terminal, names whole; the id
    # that no line can hold is cut with the mark, never split over lines
    out = io.StringIO()
    TextTable(out, SYN_COLUMNS, width=80).write(rows)
    text = out.getvalue().replace("\x1b[1m", "").replace("\x1b[0m", "")
    assert max(map(len, text.splitlines())) <= 80 and len(text.splitlines()) > 1 + len(rows)
    assert text.count(a) == 2 and text.count(b) == 1
    cut = [ln.strip() for ln in text.splitlines() if "user_id=" in ln]
    assert len(cut) == 3 and all(c.endswith(MARK) and user.startswith(c[:-1]) for c in cut)
    assert sum(ln.strip() == "state=online" for ln in text.splitlines()) == 3


def test_synapse_table_in_a_pipe_is_one_line_per_row():
    a, b, rows = _synapse_rows()
    out = io.StringIO()
    sink = Sink("table", columns=SYN_COLUMNS, out=out)
    sink.write_many(rows)
    sink.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 + len(rows) and max(map(len, lines)) > 80
    assert a in lines[1] and b in lines[2] and ESC not in out.getvalue()


def test_table_columns_appear_later_with_a_new_header():
    out = io.StringIO()
    sink = Sink("table", columns=["op", "key", "rollback_seqno"], out=out)
    sink.write_many([{"op": "mutation", "key": "a", "rollback_seqno": None}])
    sink.write_many([{"op": "stream_req", "key": None, "rollback_seqno": 42}])
    sink.close()
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["op", "key"] and lines[2].split() == ["op", "key", "rollback_seqno"]
    assert lines[3].split() == ["stream_req", "42"]


def test_inspect_render_escapes_and_keeps_names_whole():
    from dcptool.cli.inspect_cmd import render
    from dcptool.cli.view.console import data_console
    a, b, _ = _synapse_rows()
    pos = [{"stream": s, "instance": "master\x1b[31m", "token": 5, "rows": 1, "batches": 0, "positions": 1,
            "gaps": 0, "dropped": 0, "waiting": 0} for s in (a, b)]
    summary = {"protocol": "synapse", "files": [{"path": "caps/x.parquet", "in_progress": False,
                                                 "capture_id": "0123456789", "segment": 0, "rows": 2}],
               "captures": [{}], "rows": 2, "time_span": {"first": iso_ns(1), "last": iso_ns(2), "seconds": 0.0},
               "directions": {"in": 2}, "commands": {"RDATA\x1b[2J": 2}, "positions": pos, "gaps": [],
               "decode_errors": {"count": 1, "examples": [{"capture_id": "0123456789", "frame_no": 1,
                                                           "error": "bad [red]line\x1b[0m"}]}}
    out = io.StringIO()
    render(summary, data_console(out, highlight=False))
    text = out.getvalue()
    assert ESC not in text
    assert a in text and b in text and "master\\x1b[31m" in text and "RDATA\\x1b[2J" in text
    assert "bad [red]line\\x1b[0m" in text
    assert max(map(len, text.splitlines())) > 80  # a pipe: not cut at 80 columns


# ------------------------------------------------------------------ replay

def test_replay_timestamps_and_keys(tmp_path):
    from tests.support import capgen
    d = tmp_path / "dcp"
    capgen.write_captures(capgen.generate("dcp", 5, n_events=120), str(d), seed=5)
    res = _runner().invoke(cli, ["replay", str(d), "--table", "documents,frames", "--format", "jsonl"])
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    docs = [r for r in rows if r["table"] == "documents"]
    frames = [r for r in rows if r["table"] == "frames"]
    assert docs and frames
    assert all(TS.match(r["ts"]) for r in rows if r.get("ts") is not None)
    for r in docs:
        assert (r["key"] is None) != (r["key_base64"] is None)
        assert r["key"] is None or isinstance(r["key"], str)
    res = _runner().invoke(cli, ["replay", str(d), "--table", "documents", "--format", "table"])
    lines = res.stdout.splitlines()
    assert lines[0] == f"documents ({len(docs)} rows)" and "key" in lines[1].split()
    assert len(lines) == 2 + len(docs)
    assert all(re.search(r" \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", line) for line in lines[2:])
