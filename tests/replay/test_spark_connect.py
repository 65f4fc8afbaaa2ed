"""The warm Spark Connect server (`dcptool spark start|stop|status`, replay/spark/connect_server.py)
and replay through it: it starts, answers, listens on 127.0.0.1 only, is reused, gives the
checksums of the embedded local session (and --apply the local engine's output), stops on
`spark stop` and after its idle time; an unreachable --remote is one line and exit 3, and a
dead recorded server falls back to the embedded session. Two JVM starts in all (the suite's
warm server, shared with tests/hostile/test_adversary_process.py, and the one the idle test
lets stop; a later user of the shared server starts it again)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from dcptool.cli import cli
from dcptool.replay.rules import tables as T
from dcptool.replay.spark import connect_server
from dcptool.replay.spark import engine as spark_engine
from dcptool.replay.store import reader
from tests.support import capgen
from tests.support.paths import ROOT
from tests.support.ports import refused_port

pytestmark = [pytest.mark.spark, pytest.mark.integration]


@pytest.fixture(scope="module")
def state(warm_server):
    """The suite's warm server (tests/support/warm_server.py): its state directory, in this
    module's environment too (connect_server reads it), and its port (set by `_start`)."""
    saved = os.environ.get(connect_server.STATE_ENV)
    os.environ[connect_server.STATE_ENV] = warm_server.dir
    try:
        yield {"dir": warm_server.dir, "port": None, "server": warm_server}
    finally:
        if saved is None:
            os.environ.pop(connect_server.STATE_ENV, None)
        else:
            os.environ[connect_server.STATE_ENV] = saved


def dcptool(state, *args, env=None, timeout=300):
    return state["server"].dcptool(*args, env=env, timeout=timeout)


def _start(state, *args):
    """`spark start ARGS` on the running server's port, or on a picked one, picked again when
    another program took it meanwhile (WarmServer.start)."""
    r = state["server"].start(*args)
    state["port"] = state["server"].port
    return r


@pytest.fixture
def server(state):
    """The suite's warm server, started when it is not running (start is idempotent)."""
    r = _start(state, "--idle-timeout", "10m")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["running"] and info["answers"] and info["port"] == state["port"]
    return info


def _gone(pid: int, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if not connect_server.is_server_process(pid):
            return True
        time.sleep(0.2)   # a process we do not parent: poll, bounded by the deadline
    return False


def _captures(tmp_path, protocol, seed, n=300):
    d = tmp_path / f"{protocol}-{seed}"
    capgen.write_captures(capgen.generate(protocol, seed, n_events=n), str(d), seed=seed)
    return str(d)


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket of process `pid` (IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            next(f)
            for line in f:
                parts = line.split()
                local, st, inode = parts[1], parts[3], parts[9]
                if st != "0A" or inode not in inodes:   # 0A: LISTEN
                    continue
                addr_hex, port_hex = local.split(":")
                raw = bytes.fromhex(addr_hex)
                # /proc prints each 32-bit word in host (little-endian) order
                words = [raw[i:i + 4][::-1] for i in range(0, len(raw), 4)]
                b = b"".join(words)
                if width == 32 and b[:12] == b"\0" * 10 + b"\xff\xff":
                    b = b[12:]   # an IPv4-mapped IPv6 address
                addr = ".".join(str(x) for x in b) if len(b) == 4 else b.hex()
                out.append((addr, int(port_hex, 16)))
    return out


def test_start_answers_is_reused_and_listens_on_loopback_only(state, server):
    again = dcptool(state, "spark", "start", "--port", str(state["port"]), "--json")
    assert again.returncode == 0 and "already running" in again.stderr
    assert json.loads(again.stdout)["pid"] == server["pid"]
    status = json.loads(dcptool(state, "spark", "status", "--json").stdout)
    assert status["pid"] == server["pid"] and status["answers"]
    sockets = _listening(server["pid"])
    assert ("127.0.0.1", state["port"]) in sockets
    assert {addr for addr, _ in sockets} == {"127.0.0.1"}, sockets
    assert oct(os.stat(os.path.join(state["dir"], "spark-connect.json")).st_mode & 0o777) == "0o600"


def test_replay_through_the_server_gives_local_checksums(state, server, tmp_path):
    from dcptool.replay.local import engine as local
    used = os.path.join(state["dir"], "spark-connect.used")
    for protocol, seed in (("dcp", 3), ("synapse", 8)):
        d = _captures(tmp_path, protocol, seed)
        # the in-process engine: the embedded session gives its tables exactly
        # (test_replay_spark.py), in a fraction of the time
        rep = local.replay_local(reader.find_captures([d]))
        want = {n: T.checksum(n, rep.table(n)) for n in rep.names() if n != "frames"}
        os.utime(used, (0, 0))
        r = dcptool(state, "replay", "--spark", "--checksum", "--format", "jsonl", d)
        assert r.returncode == 0, r.stderr
        assert f"warm Spark Connect server sc://localhost:{state['port']} (pid {server['pid']})" in r.stderr
        assert {x["table"]: x["sha256"] for x in map(json.loads, r.stdout.splitlines())} == want
        assert os.stat(used).st_mtime > 0   # the replay marked the server as used
    assert json.loads(dcptool(state, "spark", "status", "--json").stdout)["pid"] == server["pid"]


def test_remote_url_and_apply_over_connect(state, server, tmp_path):
    d = _captures(tmp_path, "dcp", 4)
    token = connect_server.read_record().token
    local = dcptool(state, "replay", "--table", "documents", "--checksum", "--format", "jsonl", d)
    remote = dcptool(state, "replay", "--remote", f"sc://localhost:{state['port']}", "--table", "documents",
                     "--checksum", "--format", "jsonl", d, env={connect_server.TOKEN_ENV: token})
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and "Spark Connect sc://localhost" in remote.stderr
    fn = tmp_path / "per_vb.py"
    fn.write_text("import pyarrow as pa\n\ndef per_vbucket(key, table):\n"
                  "    return pa.table({'vbucket': [key], 'frames': [table.num_rows],\n"
                  "                     'last': [table.column('frame_no').to_pylist()[-1]]})\n")
    want = dcptool(state, "replay", "--apply", f"{fn}:per_vbucket", "--format", "jsonl", d)
    got = dcptool(state, "replay", "--spark", "--apply", f"{fn}:per_vbucket", "--format", "jsonl", d)
    assert want.returncode == 0 and got.returncode == 0, got.stderr
    assert got.stdout == want.stdout and len(want.stdout.splitlines()) > 1
    assert "warm Spark Connect server" in got.stderr


_SHARED_SESSION_STEPS = """
import json, os, subprocess, sys
from dcptool.replay.spark import connect_server, engine as E
capture, shared = sys.argv[1], sys.argv[2]
rec = connect_server.read_record()
replay = [sys.executable, "-m", "dcptool.cli", "replay", "--spark", "--table", "documents", "--checksum", capture]
out = {}
s = E.connect_session(rec.url, rec.token)
try:
    out["sid"], out["recorded"] = s.session_id, open(shared).read()
    r = subprocess.run(replay, capture_output=True, text=True, timeout=300)   # meanwhile
    out["meanwhile"] = [r.returncode, r.stderr]
    out["recorded_after"] = open(shared).read()
    s.conf.set("spark.sql.shuffle.partitions", "7")
finally:
    E.stop_session(s)
again = E.connect_session(rec.url, rec.token)
try:
    out["again"], out["recorded_again"] = again.session_id, open(shared).read()
    out["partitions"] = again.conf.get("spark.sql.shuffle.partitions")
finally:
    E.stop_session(again)
r = subprocess.run(replay, capture_output=True, text=True, timeout=300)
out["clean"], out["recorded_clean"] = [r.returncode, r.stderr], open(shared).read()
open(shared + ".busy", "w").close()   # as a replay killed in it leaves
k = E.connect_session(rec.url, rec.token)
try:
    out["after_kill"] = k.session_id
finally:
    E.stop_session(k)
out["busy_left"] = os.path.exists(shared + ".busy")
print(json.dumps(out))
"""


def test_replays_share_one_server_session_and_leave_nothing_in_it(state, server, tmp_path):
    """Replays on the warm server join one server session (Spark compiles generated code per
    session: a new one per replay recompiled the plan), one replay at a time: another one
    meanwhile gets a session of its own. A replay that changed the shared session (here a
    setting, as --conf does) releases it, so the next starts a clean one with a new id; so does
    one killed in it (its mark stays). In a process of its own: pyspark refuses a Connect
    session in a process that has an embedded one (this suite's shared `spark` fixture)."""
    shared_file = os.path.join(state["dir"], "spark-connect.session")
    d = _captures(tmp_path, "dcp", 6, n=100)
    env = dict(os.environ, PYTHONPATH=ROOT, **{connect_server.STATE_ENV: state["dir"]})
    for k in ("SPARK_REMOTE", "SPARK_CONNECT_MODE_ENABLED", "SPARK_LOCAL_REMOTE", connect_server.TOKEN_ENV):
        env.pop(k, None)
    p = subprocess.run([sys.executable, "-c", _SHARED_SESSION_STEPS, d, shared_file], capture_output=True,
                       text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    sid = out["sid"]
    assert out["recorded"] == sid and out["recorded_after"] == sid
    assert out["meanwhile"][0] == 0 and "warm Spark Connect server" in out["meanwhile"][1], out["meanwhile"]
    # the setting released the session: a new one, without it
    assert out["again"] != sid and out["recorded_again"] == out["again"] and out["partitions"] != "7"
    assert out["clean"][0] == 0, out["clean"]
    assert out["recorded_clean"] == out["again"]   # that replay left nothing: the same session
    assert out["after_kill"] not in (out["again"], None) and not out["busy_left"]


def test_unreachable_remote_is_one_line_and_exit_3(tmp_path):
    d = _captures(tmp_path, "dcp", 1, n=50)
    runner = CliRunner()
    with refused_port() as port:
        r = runner.invoke(cli, ["replay", "--remote", f"sc://127.0.0.1:{port}", "--checksum", d])
    assert r.exit_code == 3, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach the Spark Connect server" in lines[0]
    r = runner.invoke(cli, ["replay", "--remote", "sc://127.0.0.1:1/;token=secret", "--checksum", d])
    assert r.exit_code == 2 and "SPARK_CONNECT_AUTHENTICATE_TOKEN" in r.stderr and "secret" not in r.stderr


def test_dead_recorded_server_falls_back_to_the_embedded_session(spark, tmp_path, monkeypatch):
    monkeypatch.setenv(connect_server.STATE_ENV, str(tmp_path / "state"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setattr(spark_engine, "make_session", lambda *a, **k: spark)
    monkeypatch.setattr(spark_engine, "stop_session", lambda session: None)
    d = _captures(tmp_path, "dcp", 2, n=100)
    with refused_port() as port:
        connect_server._write_record(connect_server.Record(
            pid=dead.pid, host="127.0.0.1", port=port, token="t", log="/dev/null",
            started_at=time.time(), idle_timeout_s=60))
        r = CliRunner().invoke(cli, ["replay", "--spark", "--table", "documents", "--checksum", "--format",
                                     "jsonl", d])
    assert r.exit_code == 0, r.output
    assert f"the recorded Spark Connect server (pid {dead.pid}) is gone" in r.stderr
    assert "embedded local[*] session" in r.stderr
    local = CliRunner().invoke(cli, ["replay", "--table", "documents", "--checksum", "--format", "jsonl", d])
    assert r.stdout == local.stdout
    assert connect_server.read_record() is None   # the stale record was removed


def test_stop_and_idle_timeout(state, server):
    r = dcptool(state, "spark", "stop")
    assert r.returncode == 0 and f"pid {server['pid']}" in r.stderr
    assert _gone(server["pid"], time.monotonic() + 60)
    assert json.loads(dcptool(state, "spark", "status", "--json").stdout)["running"] is False
    r = _start(state, "--idle-timeout", "2s")
    assert r.returncode == 0, r.stderr
    pid = json.loads(r.stdout)["pid"]
    assert pid != server["pid"]
    assert _gone(pid, time.monotonic() + 90)   # stopped by its watchdog, nobody used it
    assert connect_server.read_record() is None
    assert "idle for" in open(os.path.join(state["dir"], "spark-connect.log")).read()


def test_rollbacks_and_failover_in_spark_sql_equal_the_rules(spark, tmp_path):
    """`rollbacks` and `failover` are Spark SQL (no Python workers): on captures whose
    rollbacks undo changes they equal the local engine and the row-by-row oracle."""
    from dcptool.replay.local import engine as local
    from tests.support import oracle
    undone = entries = 0
    for s in range(4):
        files = reader.find_captures([_captures(tmp_path, "dcp", s, n=200)])
        want = local.replay_local(files)
        undone += sum(want.table("rollbacks").column("undone").to_pylist())
        entries += want.table("failover").num_rows
        rep = spark_engine.replay_spark(spark, files)
        expected = oracle.dcp(files)
        try:
            for name in ("rollbacks", "failover"):
                assert rep.table(name).equals(want.table(name)), name
                assert expected[name].equals(want.table(name)), name
        finally:
            rep.close()
    assert undone > 0 and entries > 0   # the captures really have undone changes and failover logs
