"""`dcptool stream` and `capture` against hostile Synapse peers (tests/support/hostile_synapse.py),
issue 14 items 5-7: server text with terminal escape sequences (SERVER name, ERROR, row
content), RDATA rows nested far beyond any real row, and tokens beyond int64. Each test
asserts the exit code, the message, that no ESC byte reaches a terminal-bound output, and
that every line around the bad one was printed / captured."""

from __future__ import annotations

import shutil

import orjson
import pytest
from click.testing import CliRunner

from dcptool.capture import synapse_capture
from dcptool.cli import cli
from dcptool.protocol.synapse import commands as C
from dcptool.protocol.synapse.bulk import split_lines
from dcptool.protocol.synapse.client import SynapseClient
from dcptool.protocol.synapse.rows import decode_row
from dcptool.replay.store.reader import find_captures, read_capture_table
from dcptool.replay.store.synapse_batch import build_batch
from tests.support.hostile_synapse import HostileTcp, RedisPublisher, lines

pytestmark = pytest.mark.integration

ESC = "\x1b"
DEEP_ROW = "[" * 8000 + "]" * 8000          # under the 16 KiB line cap, 8000 levels deep
BIG = "123456789012345678901234567890"      # beyond int64
GOOD_BEFORE = 'RDATA events master 11 ["ev",["$before","!r","m.room.message",null,null,null,null,false,false]]'
GOOD_AFTER = 'RDATA events master 12 ["ev",["$after","!r","m.room.message",null,null,null,null,false,false]]'


@pytest.fixture(autouse=True)
def fast_knobs(monkeypatch):
    monkeypatch.setitem(synapse_capture.DEFAULTS, "backoff_base", 0.01)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "backoff_cap", 0.05)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "connect_timeout", 5.0)
    monkeypatch.setitem(synapse_capture.DEFAULTS, "max_reconnects", 1)


@pytest.fixture
def hostile():
    started = []

    def start(*items, **kw):
        s = HostileTcp(lines(*items), **kw)
        started.append(s)
        return s
    yield start
    for s in started:
        s.stop()


def run(*args):
    return CliRunner().invoke(cli, list(args), env={"DCPTOOL_PASSWORD": None})


def jsonl(out: str) -> list[dict]:
    return [orjson.loads(x) for x in out.splitlines() if x.strip()]


def captured(directory) -> list[dict]:
    files = [f for f in find_captures([str(directory)]) if f.protocol == "synapse"]
    return read_capture_table(files).to_pylist()


def _in_raws(rows) -> list[bytes]:
    return [r["raw"] for r in rows if r["direction"] == "in"]


# -------------------------------------------------------------------- 6: deeply nested JSON

DEEP_SCRIPT = ("SERVER hostile", "POSITION events master 0 10", GOOD_BEFORE,
               f"RDATA events master batch {DEEP_ROW}", GOOD_AFTER)


def test_deep_json_is_a_decode_error_not_a_crash():
    assert C.json_too_deep(DEEP_ROW)
    assert not C.json_too_deep('["[[[[[[", {"a": [1, [2]]}]')  # brackets in strings do not count
    with pytest.raises(ValueError, match="nested deeper"):
        decode_row("events", DEEP_ROW)
    with pytest.raises(C.RemoteError):
        C.parse_line("USER_IP @u:x " + "[" * 5000 + "]" * 5000)
    assert C.redact_user_ip(b"USER_IP @u:x " + b"[" * 5000 + b"]" * 5000).startswith(b"USER_IP")


@pytest.mark.parametrize("fmt", ["jsonl", "table", "text"])
def test_stream_deep_json(hostile, fmt):
    srv = hostile(*DEEP_SCRIPT)
    res = run("stream", srv.url, "--format", fmt, "--max-messages", str(len(DEEP_SCRIPT)))
    assert res.exit_code == 0, res.output
    if fmt == "jsonl":
        rows = [r for r in jsonl(res.stdout) if r["direction"] == "in"]
        assert [r["command"] for r in rows] == ["SERVER", "POSITION", "RDATA", "RDATA", "RDATA"]
        deep = rows[3]
        assert deep["decode_error"] and "nested deeper than" in deep["decode_error"]
        assert deep["row"] == DEEP_ROW  # kept as received
        assert rows[2]["fields"]["event_id"] == "$before"
        assert rows[4]["fields"]["event_id"] == "$after"
    else:
        assert "$before" in res.stdout and "$after" in res.stdout
        assert "nested deeper" in res.stdout


def test_capture_deep_json(hostile, tmp_path):
    srv = hostile(*DEEP_SCRIPT)
    res = run("capture", srv.url, "-o", str(tmp_path), "--quiet", "--json",
              "--max-messages", str(len(DEEP_SCRIPT)))
    assert res.exit_code == 0, res.output
    rows = captured(tmp_path)
    assert _in_raws(rows) == [x.encode() for x in DEEP_SCRIPT]
    deep = [r for r in rows if r["raw"].endswith(b"]]]]")][0]
    assert deep["row"] == DEEP_ROW and deep["batch"] is True


# -------------------------------------------------------------------- 7: tokens beyond int64

BIG_SCRIPT = ("SERVER hostile", "POSITION events master 0 10", GOOD_BEFORE,
              f'RDATA events master {BIG} ["ev",["$big"]]',
              f"POSITION caches master 1 {BIG}",
              f"POSITION caches master -{BIG} 5",
              GOOD_AFTER)


def test_big_token_unit():
    sp = split_lines([x.encode() for x in BIG_SCRIPT])
    assert sp.slow == [0, 1, 3, 4, 5]
    with pytest.raises(C.RemoteError, match="does not fit in int64"):
        C.parse_line(BIG_SCRIPT[3])
    assert C.parse_line("RDATA s i 9223372036854775807 []").token == 2**63 - 1
    with pytest.raises(C.RemoteError):
        C.parse_line("RDATA s i 9223372036854775808 []")
    with pytest.raises(C.RemoteError):  # thousands of digits: refused before int()
        C.parse_line("RDATA s i " + "9" * 6000 + " []")
    client = SynapseClient(keepalive=False)
    client.receive([x.encode() for x in BIG_SCRIPT], 0.0)
    assert client.committed()[("events", "master")] == 12
    assert ("caches", "master") not in client.committed()
    batch = build_batch([x.encode() for x in BIG_SCRIPT], frame_no=0, conn=1, ts_ns=0, mono_ns=0)
    rows = batch.to_pylist()
    assert [r["token"] for r in rows] == [None, None, 11, None, None, None, 12]
    assert all("int64" in rows[i]["decode_error"] for i in (3, 4, 5))


def test_stream_big_token(hostile):
    srv = hostile(*BIG_SCRIPT)
    res = run("stream", srv.url, "--format", "jsonl", "--max-messages", str(len(BIG_SCRIPT)))
    assert res.exit_code == 0, res.output
    rows = [r for r in jsonl(res.stdout) if r["direction"] == "in"]
    assert len(rows) == len(BIG_SCRIPT)
    assert rows[2]["token"] == 11 and rows[6]["token"] == 12
    for r in rows[3:6]:
        assert r["token"] is None and r.get("prev_token") is None and r.get("new_token") is None
        assert "does not fit in int64" in r["decode_error"]


def test_capture_big_token(hostile, tmp_path):
    srv = hostile(*BIG_SCRIPT)
    res = run("capture", srv.url, "-o", str(tmp_path), "--quiet", "--json",
              "--max-messages", str(len(BIG_SCRIPT)))
    assert res.exit_code == 0, res.output
    summary = orjson.loads(res.stdout.splitlines()[-1])
    assert summary["committed"]["events/master"] == 12
    rows = captured(tmp_path)
    assert _in_raws(rows) == [x.encode() for x in BIG_SCRIPT]
    bad = [r for r in rows if r["decode_error"]]
    assert len(bad) == 3 and all(r["token"] is None and r["new_token"] is None for r in bad)
    # and the capture replays (the int64 columns were built)
    res = run("replay", str(tmp_path), "--table", "positions", "--format", "jsonl")
    assert res.exit_code == 0, res.output
    pos = {r["stream"]: r for r in jsonl(res.stdout)}
    assert pos["events"]["token"] == 12


# -------------------------------------------------------------------- 5: escape sequences

EVIL = "\x1b[31mred\x1b]0;owned\x07\x1b[2J\u202e"


def _no_escape(res) -> None:
    assert ESC not in res.stdout and ESC not in res.stderr
    assert "\u202e" not in res.stderr


@pytest.mark.parametrize("fmt", ["table", "text", "jsonl"])
def test_stream_server_error_with_escapes(hostile, fmt):
    script = ("SERVER hostile", "POSITION events master 0 10", GOOD_BEFORE,
              f"ERROR {EVIL} boom", GOOD_AFTER)
    srv = hostile(*script)
    res = run("stream", srv.url, "--format", fmt, "--max-messages", "100")
    assert res.exit_code == 5, res.output
    assert "sent ERROR" in res.stderr and "\\x1b[31mred" in res.stderr and "boom" in res.stderr
    _no_escape(res)
    # everything in the burst, the lines after the ERROR included, was printed first
    assert "$before" in res.stdout and "$after" in res.stdout
    if fmt == "jsonl":
        rows = [r for r in jsonl(res.stdout) if r["direction"] == "in"]
        assert rows[3]["command"] == "ERROR" and rows[3]["args"] == f"{EVIL} boom"


def test_stream_server_name_with_escapes(hostile):
    script = (f"SERVER {EVIL}", "POSITION events master 0 10", GOOD_BEFORE)
    srv = hostile(*script)
    res = run("stream", srv.url + "?server_name=example.org", "--format", "table",
              "--max-messages", "100")
    assert res.exit_code == 5, res.output
    assert "calls itself" in res.stderr and "example.org" in res.stderr
    _no_escape(res)
    assert "$before" in res.stdout


def test_stream_row_content_with_escapes(hostile):
    script = ("SERVER hostile",
              'RDATA events master 11 ["ev",["$x\\u001b[2J","!r\u202e","m.room.message"]]',
              f"REMOTE_SERVER_UP {EVIL}", "PING 1", GOOD_AFTER)
    srv = hostile(*script)
    for fmt in ("table", "text"):
        res = run("stream", srv.url, "--format", fmt, "--max-messages", str(len(script)))
        assert res.exit_code == 0, res.output
        _no_escape(res)
        assert "\u202e" not in res.stdout
        assert "$after" in res.stdout


def test_capture_server_error_with_escapes(hostile, tmp_path):
    script = ("SERVER hostile", "POSITION events master 0 10", GOOD_BEFORE,
              f"ERROR {EVIL} boom", GOOD_AFTER)
    srv = hostile(*script)
    res = run("capture", srv.url, "-o", str(tmp_path), "--max-messages", "100")
    assert res.exit_code == 5, res.output
    assert "sent ERROR" in res.stderr
    _no_escape(res)
    rows = captured(tmp_path)
    assert _in_raws(rows) == [x.encode() for x in script]  # nothing lost, raw as received


# -------------------------------------------------------------------- Redis

@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (run scripts/setup.sh --test)")
    from tests.support.synapse_env import RedisServer
    server = RedisServer(tmp_path_factory.mktemp("redis-hostile"))
    yield server
    server.stop()


REDIS_SCRIPT = ["POSITION events master 0 10", GOOD_BEFORE,
                f'RDATA events master {BIG} ["ev",["$big"]]',
                f"RDATA events master batch {DEEP_ROW}",
                f"ERROR {EVIL}",
                'RDATA events master 11 ["ev",["$esc\\u001b[2J"]]',
                GOOD_AFTER]


@pytest.mark.parametrize("command,fmt", [("stream", "jsonl"), ("stream", "table"),
                                         ("capture", None)])
def test_redis_hostile(redis_server, tmp_path, command, fmt):
    name = f"hostile-{command}-{fmt}"
    pub = RedisPublisher(redis_server.port, name, [x.encode() for x in REDIS_SCRIPT])
    url = f"synapse+redis://127.0.0.1:{redis_server.port}?server_name={name}"
    # our own REPLICATE comes back on the channel: one more message in
    n = str(len(REDIS_SCRIPT) + 1)
    try:
        if command == "stream":
            res = run("stream", url, "--format", fmt, "--max-messages", n, "--duration", "30s")
        else:
            res = run("capture", url, "-o", str(tmp_path), "--max-messages", n, "--duration", "30s")
    finally:
        pub.stop()
    assert res.exit_code == 0, res.output
    assert pub.published == len(REDIS_SCRIPT)
    if fmt != "jsonl":
        _no_escape(res)
    if fmt == "jsonl":
        rows = [r for r in jsonl(res.stdout) if r["direction"] == "in" and r["command"] != "REPLICATE"]
        assert len(rows) == len(REDIS_SCRIPT)
        assert "int64" in rows[2]["decode_error"] and rows[2]["token"] is None
        assert "nested deeper" in rows[3]["decode_error"]
        assert rows[4]["command"] == "ERROR" and rows[4]["args"] == EVIL
        assert rows[6]["fields"]["event_id"] == "$after"
    elif fmt == "table":
        assert "$before" in res.stdout and "$after" in res.stdout and "nested deeper" in res.stdout
    else:
        raws = [r["raw"] for r in captured(tmp_path)
                if r["direction"] == "in" and not r["raw"].startswith(b"REPLICATE")]
        assert raws == [x.encode() for x in REDIS_SCRIPT]
