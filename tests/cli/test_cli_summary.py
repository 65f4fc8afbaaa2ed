"""Summaries of `stream` and `capture` count what happened in this run, for every stop
reason (--max-messages, --duration, --to, end of stream, error; signals are in
tests/hostile/test_cli_signals.py), and options are checked against what the server says
(--vbuckets beyond the bucket's, --user without a password)."""

from __future__ import annotations

import json
import re
import shlex

import orjson
import pytest
from click.testing import CliRunner

from dcptool.capture import dcp_session
from dcptool.cli import cli
from dcptool.protocol.dcp.server import producer as P
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration

COMMON = ("protocol", "source", "started_at", "ended_at", "seconds", "stopped", "messages_in",
          "messages_out", "bytes_in", "bytes_out", "connections")
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")


def _runner():
    if "mix_stderr" in CliRunner.__init__.__code__.co_varnames:
        return CliRunner(mix_stderr=False)
    return CliRunner()


def run(*args, env=None):
    res = _runner().invoke(cli, list(args), env=env or {"DCPTOOL_PASSWORD": None, "DCPTOOL_USER": None})
    rows = [orjson.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    return res, rows


def stream_summary(stderr: str) -> dict:
    """The `summary: k=v ...` line of `stream` as a dict (numbers as int/float)."""
    lines = [x for x in stderr.splitlines() if x.startswith("summary: ")]
    assert len(lines) == 1, stderr
    out = {}
    for part in shlex.split(lines[0][len("summary: "):]):
        k, _, v = part.partition("=")
        out[k] = int(v) if v.isdigit() else float(v) if re.fullmatch(r"\d+\.\d+", v) else v
    return out


def check_common(s: dict, rows: list[dict], protocol: str) -> None:
    for k in COMMON:
        assert k in s, (k, s)
    assert s["protocol"] == protocol
    assert TS.match(s["started_at"]) and TS.match(s["ended_at"])
    ins = [r for r in rows if r["direction"] == "in"]
    outs = [r for r in rows if r["direction"] == "out"]
    assert s["messages_in"] == len(ins) and s["messages_out"] == len(outs)
    assert s["connections"] == max(r["conn"] for r in rows)


def url(srv):
    return f"couchbase://{srv.host}:{srv.port}/default"


# ------------------------------------------------------------------------------ DCP stream

def test_max_messages_counts_only_what_was_shown():
    model = P.server_from_options(vbuckets=64, items=20000, seed=3)
    with ThreadedServer(model) as srv:
        res, rows = run("stream", url(srv), "--format", "jsonl", "--max-messages", "20")
    assert res.exit_code == 0, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "dcp")
    assert s["stopped"] == "max-messages" and s["messages_in"] == 20
    assert s["items"] == sum(1 for r in rows if r["op"] == "mutation") < 20
    assert s["streams_ended"] == sum(1 for r in rows if r["op"] == "stream_end") < 64


def test_to_now_counts_every_item_and_stream():
    model = P.server_from_options(vbuckets=8, items=800, seed=4)
    with ThreadedServer(model) as srv:
        res, rows = run("stream", url(srv), "--format", "jsonl")
    assert res.exit_code == 0, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "dcp")
    assert s["stopped"] == "to" and s["items"] == 800 and s["streams_ended"] == 8
    assert s["bytes_in"] > 800 * 24 and s["connections"] == 1


def test_duration_with_to_forever():
    model = P.server_from_options(vbuckets=4, items=100, seed=5)
    with ThreadedServer(model, rate=200) as srv:
        res, rows = run("stream", url(srv), "--format", "jsonl", "--to", "forever", "--duration", "0.5s")
    assert res.exit_code == 0, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "dcp")
    assert s["stopped"] == "duration" and s["items"] >= 100


def test_end_when_the_server_ends_every_stream():
    model = P.server_from_options(vbuckets=2, items=200, seed=6,
                                  scenarios=P.Scenarios(end_reasons=(0, 0)))
    with ThreadedServer(model) as srv:
        res, rows = run("stream", url(srv), "--format", "jsonl", "--to", "forever")
    assert res.exit_code == 0, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "dcp")
    assert s["stopped"] == "end" and s["streams_ended"] == 2


def test_error_keeps_the_summary_and_its_exit_code(monkeypatch):
    monkeypatch.setitem(dcp_session.DEFAULTS, "reconnects", 0)
    model = P.server_from_options(vbuckets=4, items=2000, seed=7,
                                  scenarios=P.Scenarios(disconnect_after=300))
    with ThreadedServer(model) as srv:
        res, rows = run("stream", url(srv), "--format", "jsonl")
    assert res.exit_code == 1, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "dcp")
    assert s["stopped"] == "error" and s["error"] and s["items"] > 0
    assert res.stderr.strip().splitlines()[-1].startswith("dcptool: ")


def test_capture_summary_has_the_common_fields(tmp_path):
    model = P.server_from_options(vbuckets=4, items=400, seed=8)
    with ThreadedServer(model) as srv:
        res, _ = run("capture", url(srv), "-o", str(tmp_path), "--json", "--quiet")
    assert res.exit_code == 0, res.stderr
    s = json.loads(res.stdout)
    for k in COMMON:
        assert k in s
    assert s["stopped"] == "to" and s["connections"] == 1
    assert s["messages_in"] + s["messages_out"] == s["rows"] == s["frames"]
    assert s["files"] and s["bytes_in"] > 0 and s["bytes_out"] > 0


# ------------------------------------------------------------------------------ options checked

def test_vbuckets_beyond_the_bucket_are_a_usage_error_naming_its_range(tmp_path):
    model = P.server_from_options(vbuckets=64, items=640, seed=9)
    with ThreadedServer(model) as srv:
        res, _ = run("stream", url(srv), "--vbuckets", "60-70")
        cap, _ = run("capture", url(srv), "--vbuckets", "60-70", "-o", str(tmp_path), "--quiet")
        ok, rows = run("stream", url(srv), "--vbuckets", "60-63", "--format", "jsonl")
    for r in (res, cap):
        assert r.exit_code == 2, r.stderr
        assert r.stderr.strip() == ("dcptool: --vbuckets: 64-70 out of range; the bucket has vbuckets 0-63")
    assert ok.exit_code == 0, ok.stderr
    assert stream_summary(ok.stderr)["streams_ended"] == 4


def test_user_without_password_is_a_usage_error_at_start():
    res, _ = run("stream", "couchbase://127.0.0.1:1/default", "--user", "admin")
    assert res.exit_code == 2
    assert "no password for user 'admin'" in res.stderr
    assert "DCPTOOL_PASSWORD" in res.stderr and "--password-file" in res.stderr
    res, _ = run("capture", "synapse+redis://127.0.0.1:1?server_name=x", "--user", "bob", "-o", "/nonexistent")
    assert res.exit_code == 2 and "no password for user 'bob'" in res.stderr
    # synapse:// has no authentication: a DCPTOOL_USER in the environment asks for nothing
    res, _ = run("stream", "synapse://127.0.0.1:1", env={"DCPTOOL_USER": "admin", "DCPTOOL_PASSWORD": None})
    assert res.exit_code == 3, res.stderr


# ------------------------------------------------------------------------------ Synapse

def test_synapse_max_messages_and_duration(serve):
    srv = serve("--items", "3000", "--seed", "2")
    res, rows = run("stream", f"synapse://{srv.address}", "--max-messages", "50", "--format", "jsonl")
    assert res.exit_code == 0, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "synapse")
    assert s["stopped"] == "max-messages" and s["messages_in"] == 50 and s["connections"] == 1
    res, rows = run("stream", f"synapse://{srv.address}", "--duration", "0.5s", "--format", "jsonl")
    assert res.exit_code == 0, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "synapse")
    assert s["stopped"] == "duration"


def test_synapse_error_keeps_the_summary(serve, tmp_path):
    srv = serve("--items", "3000", "--error-after", "40")
    res, rows = run("stream", f"synapse://{srv.address}", "--format", "jsonl")
    assert res.exit_code == 5, res.stderr
    s = stream_summary(res.stderr)
    check_common(s, rows, "synapse")
    assert s["stopped"] == "error" and "scripted error" in s["error"]
    assert sum(1 for r in rows if r["command"] == "RDATA") == 40
    cap, _ = run("capture", f"synapse://{srv.address}", "-o", str(tmp_path), "--json", "--quiet")
    assert cap.exit_code == 5, cap.stderr
    c = json.loads(cap.stdout)
    assert c["stopped"] == "error" and c["rows"] == c["messages_in"] + c["messages_out"] == c["lines"]
