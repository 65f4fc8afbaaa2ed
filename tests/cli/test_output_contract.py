"""The output contract (docs/CLI.md), the same for DCP and Synapse: every command run
against `serve dcp` and `serve synapse` (stream, capture, then inspect and replay on the
captures) prints timestamps as RFC 3339 UTC with 9 fraction digits and `Z`, gives every
JSON line of a command the same keys (absent fields null), numbers connections from 1,
ends with summaries that share the common fields, and exits with the same code in the same
situation (connection refused 3, bad URL 2)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess

import pytest

from tests.support.paths import DCPTOOL
from tests.support.ports import refused_port

pytestmark = pytest.mark.integration
TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z$")
LOOKS_LIKE_TS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:")
COMMON = {"protocol", "source", "started_at", "ended_at", "seconds", "stopped", "messages_in",
          "messages_out", "bytes_in", "bytes_out", "connections"}


def dcptool(*args, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("DCPTOOL_USER", "DCPTOOL_PASSWORD")}
    return subprocess.run([DCPTOOL, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def sources():
    procs = []
    urls = {}
    try:
        for which, args, make in (
                ("dcp", ["--vbuckets", "4", "--items", "200", "--rate", "50"],
                 lambda a: f"couchbase://{a}/default"),
                ("synapse", ["--items", "0", "--rate", "50"], lambda a: f"synapse://{a}")):
            p = subprocess.Popen([DCPTOOL, "serve", which, "--port", "0", *args],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(p)
            urls[which] = make(json.loads(p.stdout.readline())["listening"])
        yield urls
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        assert [p.returncode for p in procs] == [0] * len(procs)   # both servers stop alike


def timestamps_ok(value, where):
    """Every string that looks like a timestamp, anywhere in value, is the contract's."""
    if isinstance(value, dict):
        for k, v in value.items():
            timestamps_ok(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            timestamps_ok(v, f"{where}[{i}]")
    elif isinstance(value, str) and LOOKS_LIKE_TS.match(value):
        assert TS.match(value), (where, value)


def jsonl(text):
    return [json.loads(x) for x in text.splitlines() if x.strip()]


def same_keys(rows, group=None):
    groups: dict = {}
    for r in rows:
        groups.setdefault(r.get(group) if group else None, []).append(r)
    for name, rs in groups.items():
        # the same key set on every line (JSON objects are unordered; stream's JSON lines put
        # the keys that vary in a batch first, replay/rows.py jsonl_of)
        keys = {frozenset(r) for r in rs}
        assert len(keys) == 1, (name, keys)


def stream_summary(stderr):
    line = next(x for x in stderr.splitlines() if x.startswith("summary: "))
    return dict(p.partition("=")[::2] for p in shlex.split(line[len("summary: "):]))


@pytest.fixture(scope="module")
def runs(sources, tmp_path_factory):
    out = {}
    for which, url in sources.items():
        d = tmp_path_factory.mktemp(f"cap-{which}")
        extra = ["--to", "forever"] if which == "dcp" else []
        out[which] = {
            "stream": dcptool("stream", url, "--format", "jsonl", "--max-messages", "60", *extra),
            "capture": dcptool("capture", url, "-o", str(d), "--json", "--quiet", "--duration", "1.5s", *extra),
            "dir": d,
        }
        out[which]["inspect"] = dcptool("inspect", str(d), "--json")
        out[which]["replay"] = dcptool("replay", str(d), "--format", "jsonl", "--table", "all")
    return out


@pytest.mark.parametrize("which", ["dcp", "synapse"])
def test_stream_rows(runs, which):
    res = runs[which]["stream"]
    assert res.returncode == 0, res.stderr
    rows = jsonl(res.stdout)
    assert sum(1 for r in rows if r["direction"] == "in") == 60
    same_keys(rows)
    for r in rows:
        assert TS.match(r["ts"]), r["ts"]
        timestamps_ok(r, "row")
    assert min(r["conn"] for r in rows) == 1
    assert {"frame_no", "conn", "ts", "direction", "decode_error"} <= set(rows[0])
    s = stream_summary(res.stderr)
    assert COMMON <= set(s), s
    assert s["protocol"] == which and s["stopped"] == "max-messages" and s["messages_in"] == "60"
    assert TS.match(s["started_at"]) and TS.match(s["ended_at"]) and s["connections"] == "1"


@pytest.mark.parametrize("which", ["dcp", "synapse"])
def test_capture_summary_and_files(runs, which):
    res = runs[which]["capture"]
    assert res.returncode == 0, res.stderr
    s = json.loads(res.stdout)
    assert COMMON | {"files", "rows"} <= set(s), s
    assert s["protocol"] == which and s["stopped"] == "duration" and s["connections"] == 1
    assert s["rows"] == s["messages_in"] + s["messages_out"] > 0
    timestamps_ok(s, "summary")
    import pyarrow.parquet as pq
    conns = set()
    for f in s["files"]:
        conns |= set(pq.read_table(f["path"], columns=["conn"]).column("conn").to_pylist())
    assert min(conns) == 1


def test_dcp_and_synapse_summaries_share_their_common_fields(runs):
    keys = [set(json.loads(runs[w]["capture"].stdout)) for w in ("dcp", "synapse")]
    assert COMMON | {"files", "rows", "bytes", "signal", "error"} <= keys[0] & keys[1]
    lines = [set(stream_summary(runs[w]["stream"].stderr)) for w in ("dcp", "synapse")]
    assert COMMON <= lines[0] & lines[1]


@pytest.mark.parametrize("which", ["dcp", "synapse"])
def test_inspect_and_replay_of_the_captures(runs, which):
    ins = runs[which]["inspect"]
    assert ins.returncode == 0, ins.stderr
    timestamps_ok(json.loads(ins.stdout), "inspect")
    rep = runs[which]["replay"]
    assert rep.returncode == 0, rep.stderr
    rows = jsonl(rep.stdout)
    assert rows
    same_keys(rows, group="table")
    for r in rows:
        timestamps_ok(r, f"replay.{r.get('table')}")


@pytest.mark.parametrize("command", ["stream", "capture"])
def test_same_exit_codes_for_the_same_situations(tmp_path, command):
    out = ["-o", str(tmp_path)] if command == "capture" else []
    with refused_port() as port:
        refused = [dcptool(command, u, *out, timeout=60) for u in
                   (f"couchbase://127.0.0.1:{port}/default", f"synapse://127.0.0.1:{port}")]
    assert [r.returncode for r in refused] == [3, 3], [r.stderr for r in refused]
    for r in refused:
        assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("dcptool: ")
    bad = [dcptool(command, u, *out, timeout=60) for u in ("couchbase://127.0.0.1", "synapse://127.0.0.1")]
    assert [r.returncode for r in bad] == [2, 2], [r.stderr for r in bad]


def test_stream_columns_are_the_capture_formats():
    """`stream` rows carry the capture format's columns (replay/store/schema.py) plus key_base64,
    minus capture_id (a capture's, not a stream's) and raw (only with --raw); --values adds
    the value columns of the output contract."""
    from dcptool.replay.rows import row_columns
    from dcptool.replay.store.schema import column_names
    want = set(column_names("dcp")) - {"capture_id", "raw"} | {"key_base64", "snap_flag_names"}
    assert set(row_columns()) == want
    assert set(row_columns(values=True, raw=True)) == want | {"value", "value_base64", "value_error", "raw"}
