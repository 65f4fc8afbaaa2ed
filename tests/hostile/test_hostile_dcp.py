"""Hostile DCP servers (tests/support/hostile_dcp.py) against the real CLI in a subprocess: every
case must end by itself with its documented exit code and one clear stderr line, and what
arrived before the bad part must be printed (`stream`) or readable (`capture`). Issue 14,
items 1-4 and the DCP part of 5. Each subprocess is bounded by a timeout far above what the
case needs; `--timeout 1s` keeps them short."""

from __future__ import annotations

import os
import subprocess

import orjson
import pytest

from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.wire import messages as m
from dcptool.protocol.dcp.wire import sasl
from dcptool.protocol.errors import ErrorCode, RemoteError
from tests.support.cli_util import error_line
from tests.support.hostile_dcp import HostileDcp, half_frame, mutation
from tests.support.paths import DCPTOOL

pytestmark = pytest.mark.integration
BOUND = 90          # seconds: a hang fails the test instead of stalling the suite
PASSWORD_ENV = {"DCPTOOL_PASSWORD": "not-the-real-one"}


def run(url, *args, cmd="stream", env=None):
    full = [DCPTOOL, cmd, url, *args]
    if cmd == "stream":
        full += ["--format", "jsonl"]
    res = subprocess.run(full, capture_output=True, text=True, timeout=BOUND,
                         env=dict(os.environ, **(env or {})))
    rows = [orjson.loads(line) for line in res.stdout.splitlines() if line.startswith("{")] \
        if cmd == "stream" else []
    return res, rows


def items(rows, conn=None):
    return [(r["vbucket"], r["by_seqno"]) for r in rows
            if r["direction"] == "in" and r["op"] == "mutation" and (conn is None or r["conn"] == conn)]


def captured(outdir):
    from dcptool.replay.store.reader import find_captures, read_capture_table
    return read_capture_table(find_captures([str(outdir)])).to_pylist()


# --------------------------------------------------------------------------- 1. timeouts

def test_silent_after_accept_times_out_at_hello():
    with HostileDcp(silent_at=0) as srv:
        res, rows = run(srv.url, "--timeout", "1s")
    assert res.returncode == 3, res.stderr
    line = error_line(res)
    assert "no answer to HELLO" in line and "--timeout" in line
    assert [r["op"] for r in rows] == ["hello"] and rows[0]["direction"] == "out"


def test_tls_handshake_to_a_silent_server_times_out():
    with HostileDcp(silent_at=0) as srv:
        url = f"couchbases://{srv.host}:{srv.port}/default"
        res, rows = run(url, "--timeout", "1s", "--insecure")
    assert res.returncode == 3, res.stderr
    assert "timed out connecting" in error_line(res) and "TLS handshake" in error_line(res)
    assert rows == []


@pytest.mark.parametrize("opcode,step,user", [
    (0x20, "SASL_LIST_MECHS", True),
    (0x21, "SASL_AUTH", True),
    (0x89, "SELECT_BUCKET", False),
    (0x48, "GET_ALL_VB_SEQNOS", False),
    (0x50, "DCP_OPEN", False),
    (0x5E, "DCP_CONTROL", False),
])
def test_every_handshake_step_is_bounded(opcode, step, user):
    with HostileDcp(silent_at=opcode) as srv:
        args = ["--timeout", "1s"] + (["--user", "alice"] if user else [])
        res, rows = run(srv.url, *args, env=PASSWORD_ENV if user else None)
    assert res.returncode == 3, res.stderr
    assert f"no answer to {step}" in error_line(res)
    # every frame before the silence was printed, the unanswered request last of its kind
    assert rows and rows[0]["op"] == "hello"
    assert rows[-1]["direction"] == "out" or rows[-1]["op"] == "control"


def test_unanswered_stream_request_reconnects_then_exits_1():
    with HostileDcp(silent_at=0x53) as srv:
        res, rows = run(srv.url, "--timeout", "1s", "--vbuckets", "0")
        connections = srv.connections
    assert res.returncode == 1, res.stderr
    line = error_line(res)
    # `stream` reconnects as often as `capture` (issue 35: one session, one count: 5)
    assert "no answer to DCP_STREAM_REQ (vbucket 0)" in line and "gave up after 5 reconnect(s)" in line
    assert connections == 6
    assert {r["conn"] for r in rows} == {1, 2, 3, 4, 5, 6}


def test_half_frame_during_handshake_times_out():
    # a HELLO answer announcing 20 MiB, then one byte every 0.3 s: never whole
    with HostileDcp(half_frame_at=0x1F, drip=0.3) as srv:
        res, rows = run(srv.url, "--timeout", "1s")
    assert res.returncode == 3, res.stderr
    line = error_line(res)
    assert "a frame stopped half way" in line and f"of {24 + 20 * 1024 * 1024} bytes" in line


def test_half_frame_while_streaming_reconnects_and_capture_keeps_everything(tmp_path):
    # vbucket 0's stream stops inside a frame after its 3 items: the capture drops the
    # connection after --timeout, resumes vbucket 0 from seqno 3 (and vbucket 1, whose
    # answer was behind the half frame, from 0) and finishes
    with HostileDcp(items=3, inject=[half_frame()]) as srv:
        res, _ = run(srv.url, "-o", str(tmp_path), "--quiet", "--json", "--timeout", "1s", cmd="capture")
    assert res.returncode == 0, res.stderr
    rows = captured(tmp_path)
    got = sorted((r["vbucket"], r["by_seqno"]) for r in rows if r["direction"] == "in" and r["op"] == "mutation")
    assert got == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]   # exactly once
    assert {r["conn"] for r in rows} == {1, 2}
    reqs = [r for r in rows if r["op"] == "stream_req" and r["direction"] == "out" and r["conn"] == 2]
    # vbucket 1's stream was queued behind the half frame: conn 2 asks for it from 0
    assert [(r["vbucket"], r["req_start_seqno"]) for r in reqs] == [(0, 3), (1, 0)]


def test_refused_noop_gets_our_idle_timeout():
    with HostileDcp(refuse_controls={"enable_noop"}, end_streams=False) as srv:
        res, rows = run(srv.url, "--timeout", "1s", "--noop-interval", "0.2s", "--to", "forever")
        connections = srv.connections
    assert res.returncode == 1, res.stderr
    line = error_line(res)
    assert "refused noops" in line and "gave up after 5 reconnect(s)" in line
    assert "DCP_CONTROL enable_noop=true refused" in res.stderr
    assert connections == 6
    # each connection resumed where the previous stopped: every item exactly once, on conn 1
    assert sorted(items(rows)) == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3)]
    assert sorted(items(rows, conn=1)) == sorted(items(rows))


def test_timeout_must_be_positive():
    res, _ = run("couchbase://127.0.0.1:1/default", "--timeout", "0s")
    assert res.returncode == 2 and "--timeout" in res.stderr


# --------------------------------------------------------------------------- 2, 3. SASL bounds

def test_endless_auth_continue_is_refused():
    with HostileDcp(sasl_endless=True) as srv:
        res, rows = run(srv.url, "--user", "alice", "--timeout", "5s", env=PASSWORD_ENV)
        rounds = srv.sasl_rounds
    assert res.returncode == 5, res.stderr
    assert "another SASL step after the final SCRAM message" in error_line(res)
    assert rounds == 2          # SASL_AUTH and one SASL_STEP, then we stopped
    assert [r["op"] for r in rows if r["direction"] == "out"][-1] == "sasl_step"


def test_scram_iteration_count_above_the_ceiling_is_refused_before_computing():
    with HostileDcp(iterations=2_000_000_000) as srv:
        res, rows = run(srv.url, "--user", "alice", "--timeout", "5s", env=PASSWORD_ENV)
    assert res.returncode == 5, res.stderr
    line = error_line(res)
    assert "2,000,000,000 PBKDF2 iterations" in line and "1,000,000" in line
    assert "sasl_step" not in [r["op"] for r in rows]   # no proof was computed or sent


def test_scram_client_limits_without_a_server():
    client = sasl.ScramClient("SCRAM-SHA256", "alice", "pw", nonce=b"abc")
    first = b"r=abcdef,s=" + b"c2FsdA==" + b",i=%d"
    with pytest.raises(RemoteError) as e:
        client.final(first % (sasl.MAX_SCRAM_ITERATIONS + 1))
    assert e.value.code == ErrorCode.SASL_LIMIT
    client.final(first % 4096)
    with pytest.raises(RemoteError) as e:   # a second AUTH_CONTINUE
        client.final(first % 4096)
    assert e.value.code == ErrorCode.SASL_LIMIT


# --------------------------------------------------------------------------- 4. vbucket ids

@pytest.mark.parametrize("n", [3, 200])   # 200: the vectorised receive path
def test_vbucket_65535_is_a_protocol_error_after_printing_what_came_before(n):
    with HostileDcp(items=n, inject=[mutation(65535, n + 1, b"bad", 7)]) as srv:
        res, rows = run(srv.url, "--vbuckets", "0")
    assert res.returncode == 5, res.stderr
    assert "mutation for vbucket 65535" in error_line(res)
    assert items(rows) == [(0, s) for s in range(1, n + 1)] + [(65535, n + 1)]


def test_vbucket_65535_capture_keeps_every_frame(tmp_path):
    with HostileDcp(items=3, inject=[mutation(65535, 4, b"bad", 7)]) as srv:
        res, _ = run(srv.url, "-o", str(tmp_path), "--quiet", "--json", "--vbuckets", "0", cmd="capture")
    assert res.returncode == 5, res.stderr
    assert "mutation for vbucket 65535" in error_line(res)
    rows = captured(tmp_path)
    got = [(r["vbucket"], r["by_seqno"]) for r in rows if r["direction"] == "in" and r["op"] == "mutation"]
    assert got == [(0, 1), (0, 2), (0, 3), (65535, 4)]
    assert orjson.loads(res.stdout)["rows"] == len(rows)
    # --resume over that capture skips the impossible vbucket and continues vbucket 0
    with HostileDcp(items=5) as srv:
        res, _ = run(srv.url, "-o", str(tmp_path), "--quiet", "--json", "--vbuckets", "0", "--resume",
                     cmd="capture")
    assert res.returncode == 0, res.stderr
    rows = captured(tmp_path)
    got = [(r["vbucket"], r["by_seqno"]) for r in rows if r["direction"] == "in" and r["op"] == "mutation"]
    assert got == [(0, 1), (0, 2), (0, 3), (65535, 4), (0, 4), (0, 5)]


def test_vbucket_list_beyond_1023_is_a_protocol_error():
    with HostileDcp(seqnos=[(0, 3), (65535, 3)]) as srv:
        res, rows = run(srv.url)
    assert res.returncode == 5, res.stderr
    assert "GET_ALL_VB_SEQNOS lists vbucket 65535" in error_line(res)
    assert rows[-1]["op"] == "get_all_vb_seqnos" and rows[-1]["direction"] == "in"


def test_unrequested_vbucket_frame_is_shown_and_ignored():
    # vbucket 7 is in range but not ours: printed, not applied, no crash
    end = lambda opaque: m.encode(m.StreamEnd(vbucket=0, opaque=opaque, reason=0))  # noqa: E731
    with HostileDcp(items=3, inject=[mutation(7, 1, b"stray", 99), end]) as srv:
        res, rows = run(srv.url, "--vbuckets", "0")
    assert res.returncode == 0, res.stderr
    assert items(rows) == [(0, 1), (0, 2), (0, 3), (7, 1)]
    assert "Traceback" not in res.stderr and "dcptool:" not in res.stderr


# --------------------------------------------------------------------------- 5. server text

def test_escape_sequences_in_the_mechanism_list_are_escaped():
    evil = b"EVIL\x1b[31mRED\x1b]0;title\x07 [bold]x[/bold]"
    with HostileDcp(mechs=evil) as srv:
        res, _ = run(srv.url, "--user", "alice", env=PASSWORD_ENV)
    assert res.returncode == 4, res.stderr
    line = error_line(res)
    assert "\x1b" not in res.stderr and "\x07" not in res.stderr
    assert r"EVIL\x1b[31mRED\x1b]0;title\x07 [bold]x[/bold]" in line


# --------------------------------------------------------------------------- sans-IO clocks

def _consumer(**kw) -> dcp_consumer.Consumer:
    c = dcp_consumer.Consumer(dcp_consumer.ConsumerConfig(bucket="default", name="t", vbuckets=[0], **kw), now=100.0)
    c.start(100.0)
    return c


def test_consumer_times_out_an_unanswered_request_and_hold_restarts_the_clock():
    c = _consumer(timeout=5.0)
    c.check(105.0)                        # exactly the timeout: still waiting
    c.hold(104.0)                         # we held reads back: the wait restarts
    c.check(108.5)
    with pytest.raises(RemoteError) as e:
        c.check(109.5)
    assert e.value.code == ErrorCode.TIMEOUT and "HELLO" in e.value.message


def test_time_spent_before_a_request_leaves_does_not_count():
    c = _consumer(timeout=5.0)            # HELLO queued at 100
    c.link.stamp_sent(103.0)                   # ... and written at 103 (after long local work)
    c.check(107.5)
    with pytest.raises(RemoteError):
        c.check(108.5)


def test_idle_limit_follows_the_noop_answer():
    c = _consumer(timeout=5.0, noop_interval=1.0, buffer_size=0)
    assert c.handshake.idle_limit() is None         # not streaming yet
    frames = [m.encode(m.HelloResponse(opaque=1)), m.encode(m.Response(opcode=0x89, opaque=2)),
              m.encode(m.Response(opcode=0x50, opaque=3))]
    c.feed(b"".join(frames), 100.0)
    ctrl = [m.decode_bytes(f) for f in c.outgoing() if f[1] == 0x5E]
    answers = [m.encode(m.Response(opcode=0x5E, opaque=q.opaque, status=0x83 if q.key == b"enable_noop" else 0))
               for q in ctrl]
    c.feed(b"".join(answers), 100.0)
    assert c.handshake.streaming and not c.handshake.noop_active
    assert c.handshake.idle_limit() == 5.0          # max(2 x 1 s, timeout 5 s)
    assert _consumer(noop_interval=0).handshake.idle_limit() is None


def test_ctrl_c_while_waiting_for_a_silent_server_exits_130():
    import signal
    with HostileDcp(silent_at=0) as srv:
        proc = subprocess.Popen([DCPTOOL, "stream", srv.url, "--format", "jsonl", "--timeout", "60s"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()        # the HELLO went out: we are waiting now
            assert orjson.loads(first)["op"] == "hello"
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=BOUND)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err


def test_verbose_traceback_escapes_server_text_too():
    with HostileDcp(mechs=b"EVIL\x1b[2J") as srv:
        res = subprocess.run([DCPTOOL, "-v", "stream", srv.url, "--format", "jsonl", "--user", "alice"],
                             capture_output=True, text=True, timeout=BOUND, env=dict(os.environ, **PASSWORD_ENV))
    assert res.returncode == 4
    assert "Traceback" in res.stderr and "\x1b" not in res.stderr and r"EVIL\x1b[2J" in res.stderr
