"""Issue 24, items 1, 3, 5, 12 and 14: nothing wedged, nobody else's process touched.

- A path typed on the command line means what it means in the user's working directory on
  every engine, the warm Spark Connect server included (it resolves relative paths against
  its own).
- `spark stop` never signals a process whose pid, start time and command line do not prove
  it is the one its record names; a stale record is reported and removed.
- A stop signal ends a command within 2 s whatever stdout does (a pipe nobody reads, a port
  that never answers as gRPC); a closed stdout is one line, never a traceback or a hang.
- `--apply`: the function's prints go to stderr, sys.exit() and exceptions are one line
  naming the function (also on the warm server).
- An unusable state directory is named with DCPTOOL_STATE_DIR; `replay --spark` then runs on
  the embedded session.

The liveness bounds below (10 s and more) are generous bounds for "it ended", not timings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dcptool.protocol.dcp.server import producer as P
from tests.support import capgen
from tests.support.synapse_serve import ServeSynapse as SynapseServer
from tests.support.threaded_server import ThreadedServer

pytestmark = pytest.mark.integration
DCPTOOL = os.path.join(os.path.dirname(sys.executable), "dcptool")
ENDED_WITHIN = 10.0   # liveness: the command ended (its own bound is 2 s)


def _env(**extra):
    env = dict(os.environ)
    env.update(extra)
    return env


def _captures(directory, protocol="dcp", seed=5, n=200):
    capgen.write_captures(capgen.generate(protocol, seed, n_events=n, max_captures=1), str(directory), seed=seed)
    return str(directory)


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.startswith("dcptool:")]
    assert len(lines) == 1, stderr
    return lines[0]


def _until(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)   # waiting for another process: poll, bounded by the deadline


# --- item 3: spark stop ----------------------------------------------------------------------

def _record(state_dir, **fields):
    rec = {"pid": 1, "host": "127.0.0.1", "port": 1, "token": "t", "log": "l", "started_at": 0.0,
           "idle_timeout_s": 0.0}
    rec.update(fields)
    with open(os.path.join(state_dir, "spark-connect.json"), "w") as f:
        json.dump(rec, f)


def _stop(state_dir):
    return subprocess.run([DCPTOOL, "spark", "stop"], capture_output=True, text=True, timeout=60,
                          env=_env(DCPTOOL_STATE_DIR=str(state_dir)))


def test_spark_stop_never_signals_an_unrelated_watchdog_pid(tmp_path):
    bystander = subprocess.Popen(["sleep", "120"])
    try:
        _record(tmp_path, pid=1, watchdog_pid=bystander.pid)
        res = _stop(tmp_path)
        assert res.returncode == 0, res.stderr
        assert bystander.poll() is None, "spark stop signalled a process that is not its watchdog"
        assert "stale record" in res.stderr and "stopped the Spark Connect server" not in res.stderr
        assert not os.path.exists(tmp_path / "spark-connect.json")
    finally:
        bystander.kill()
        bystander.wait()


def test_spark_stop_checks_the_start_time_of_a_watchdog_look_alike(tmp_path):
    """A process with the watchdog's command line but another start time (the pid was reused)
    is not signalled, nor is a dead server pid reported as stopped."""
    look_alike = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                   "dcptool.replay.spark.connect_server", "watch", "1"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        _record(tmp_path, pid=dead.pid, watchdog_pid=look_alike.pid, watchdog_start=1, pid_start=1)
        res = _stop(tmp_path)
        assert res.returncode == 0, res.stderr
        assert look_alike.poll() is None
        assert "stale record" in res.stderr and f"pid {dead.pid}" in res.stderr
        assert "stopped the Spark Connect server" not in res.stderr
    finally:
        look_alike.kill()
        look_alike.wait()


# --- item 14: an unusable state directory -------------------------------------------------------

def _no_state_env(home):
    env = _env(HOME=str(home))
    for k in ("DCPTOOL_STATE_DIR", "XDG_STATE_HOME"):
        env.pop(k, None)
    return env


def test_unusable_state_directory_is_named_with_the_variable_to_set(tmp_path):
    home = tmp_path / "home-is-a-file"
    home.write_text("")
    for args in (["spark", "status"], ["spark", "stop"]):
        res = subprocess.run([DCPTOOL, *args], capture_output=True, text=True, timeout=60, env=_no_state_env(home))
        assert res.returncode == 1, (args, res.stderr)
        line = _one_error_line(res.stderr)
        assert str(home / ".local" / "state" / "dcptool") in line and "DCPTOOL_STATE_DIR" in line, line


@pytest.mark.spark
def test_replay_spark_falls_back_to_the_embedded_session_without_a_state_directory(fresh_spark_cli):
    # `replay CAP --spark --checksum` with HOME a file and no DCPTOOL_STATE_DIR, run in the
    # shared fresh process of tests/support/fresh_spark.py (one JVM start for three tests)
    cap = fresh_spark_cli.captures["fallback"]
    local = subprocess.run([DCPTOOL, "replay", cap, "--checksum"], capture_output=True, text=True, timeout=300)
    res = fresh_spark_cli.runs["fallback"]
    assert res.returncode == 0, res.stderr
    assert res.stdout == local.stdout and local.stdout
    assert "DCPTOOL_STATE_DIR" in res.stderr and "embedded local[*] session" in res.stderr


# --- item 5: closed and unread stdout ---------------------------------------------------------

def _closed_stdout(args, cwd=None):
    return subprocess.run([DCPTOOL, *args], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          timeout=120, close_fds=True, pass_fds=(), cwd=cwd,
                          preexec_fn=lambda: os.close(1))


@pytest.mark.parametrize("cmd", [["replay", "{cap}", "--checksum"], ["inspect", "{cap}"], ["verify", "{cap}"],
                                 ["stream", "couchbase://127.0.0.1:1/default", "--timeout", "3s"]])
def test_closed_stdout_is_one_line_and_exit_1(tmp_path, cmd):
    cap = _captures(tmp_path / "cap")
    res = _closed_stdout([a.format(cap=cap) for a in cmd])
    assert res.returncode == 1, res.stderr
    assert "standard output is closed" in _one_error_line(res.stderr)


def test_capture_json_with_closed_stdout_keeps_the_capture(tmp_path):
    model = P.server_from_options(vbuckets=4, items=50, seed=31)
    out = tmp_path / "c"
    with ThreadedServer(model) as srv:
        res = _closed_stdout(["capture", f"couchbase://{srv.host}:{srv.port}/default", "-o", str(out),
                              "--quiet", "--json"])
    assert res.returncode == 1, res.stderr
    assert "standard output is closed" in _one_error_line(res.stderr)
    from dcptool.replay.store.reader import find_captures, read_capture_table
    files = find_captures([str(out)])
    assert files and all(not f.in_progress for f in files)
    assert read_capture_table(files).num_rows > 50


def test_stream_into_a_pipe_closed_before_the_first_row_is_exit_0(tmp_path):
    model = P.server_from_options(vbuckets=4, items=50, seed=32)
    r, w = os.pipe()
    os.close(r)   # the reader is gone before the first frame is shown
    with ThreadedServer(model) as srv:
        try:
            res = subprocess.run([DCPTOOL, "stream", f"couchbase://{srv.host}:{srv.port}/default", "--format", "jsonl",
                                  "--to", "forever", "--timeout", "3s"], stdout=w, stderr=subprocess.PIPE, text=True,
                                 timeout=60)
        finally:
            os.close(w)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr and "Exception" not in res.stderr


def _unread_stream(url, *args):
    """`dcptool stream URL` writing into a pipe nobody reads: (process, the pipe's read end)."""
    r, w = os.pipe()
    p = subprocess.Popen([DCPTOOL, "stream", url, "--format", "jsonl", "--values", *args], stdout=w,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(w)
    return p, r


def _pipe_filled(r):
    """Once the writer has begun (the pipe holds some of its rows), the rest of the pipe's room
    is taken here, through a write end of our own on the same pipe: the pipe is then full and
    every further write of the process waits for a reader that never comes. Waiting for the
    process to fill it alone was not deterministic: it writes without blocking and polls, so
    no wait channel shows it stuck, and how full a pipe of 16 pages gets depends on how its
    writes were cut (~56,000 bytes of ~700-byte rows, 60,850 on a loaded host)."""
    import array
    import fcntl
    import termios
    buf = array.array("i", [0])
    fcntl.ioctl(r, termios.FIONREAD, buf)
    if buf[0] == 0:
        return False
    fd = os.open(f"/proc/self/fd/{r}", os.O_WRONLY | os.O_NONBLOCK)
    try:
        for size in (4096, 512, 64, 8, 1):   # a write up to PIPE_BUF goes in whole or not at all
            while True:
                try:
                    os.write(fd, b"\n" * size)
                except BlockingIOError:
                    break
    finally:
        os.close(fd)
    return True


def _ends(p, r, sig=None):
    try:
        if sig is not None:
            p.send_signal(sig)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        return p.returncode, time.monotonic() - t0, err.decode()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(r)


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_dcp_stream_into_an_unread_pipe_ends_on_signals(sig, code):
    model = P.server_from_options(vbuckets=8, items=3000, seed=33, value_size=300)
    with ThreadedServer(model) as srv:
        p, r = _unread_stream(f"couchbase://{srv.host}:{srv.port}/default", "--to", "forever")
        _until(lambda: _pipe_filled(r) or p.poll() is not None)
        assert p.poll() is None
        rc, took, err = _ends(p, r, sig)
    assert rc == code, err
    assert took < ENDED_WITHIN
    assert any(ln.startswith("summary: ") and f"signal={signal.Signals(sig).name}" in ln for ln in err.splitlines())
    assert "Traceback" not in err


def test_synapse_stream_into_an_unread_pipe_ends_on_sigterm():
    srv = SynapseServer("--items", "3000", "--rate", "0")
    try:
        p, r = _unread_stream(f"synapse://{srv.address}")
        _until(lambda: _pipe_filled(r) or p.poll() is not None)
        assert p.poll() is None
        rc, took, err = _ends(p, r, signal.SIGTERM)
    finally:
        srv.stop()
    assert rc == 143, err
    assert took < ENDED_WITHIN and "Traceback" not in err


def test_stream_duration_ends_although_nobody_reads_stdout():
    model = P.server_from_options(vbuckets=8, items=3000, seed=34, value_size=300)
    with ThreadedServer(model) as srv:
        t0 = time.monotonic()
        p, r = _unread_stream(f"couchbase://{srv.host}:{srv.port}/default", "--to", "forever", "--duration", "2s")
        rc, _, err = _ends(p, r)
        took = time.monotonic() - t0
    assert took < 2 + ENDED_WITHIN, took
    assert rc == 1, err
    assert "nobody read standard output" in _one_error_line(err)
    assert any(ln.startswith("summary: ") for ln in err.splitlines())


def test_replay_into_an_unread_pipe_ends_on_sigterm(tmp_path):
    cap = _captures(tmp_path / "cap", n=3000)
    r, w = os.pipe()
    p = subprocess.Popen([DCPTOOL, "replay", cap, "--table", "frames", "--format", "jsonl"], stdout=w,
                         stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(w)
    _until(lambda: _pipe_filled(r) or p.poll() is not None)
    assert p.poll() is None
    rc, took, err = _ends(p, r, signal.SIGTERM)
    assert rc == 143, err
    assert took < ENDED_WITHIN
    assert _one_error_line(err) == "dcptool: stopped by SIGTERM"


# --- item 5: --remote on a port that is not Spark Connect --------------------------------------

def test_remote_on_a_dcp_port_is_one_line_and_exit_3(tmp_path):
    cap = _captures(tmp_path / "cap")
    model = P.server_from_options(vbuckets=4, items=10, seed=35)
    with ThreadedServer(model) as srv:
        t0 = time.monotonic()
        res = subprocess.run([DCPTOOL, "replay", cap, "--remote", f"sc://127.0.0.1:{srv.port}", "--checksum"],
                             capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
    assert res.returncode == 3, res.stderr
    assert "no Spark Connect" in _one_error_line(res.stderr)
    assert took < 10 + ENDED_WITHIN   # 10 s of waiting (CLI.md) and the start of the process


class SilentServer:
    """A TCP port on 127.0.0.1 that accepts connections, keeps them open and never answers
    (a server of another protocol waiting for its own first bytes)."""

    def __init__(self):
        import socket
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self):
        self.sock.close()
        for c in self.accepted:
            c.close()


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_remote_on_a_silent_port_ends_on_a_signal(tmp_path, sig, code):
    cap = _captures(tmp_path / "cap")
    srv = SilentServer()
    try:
        p = subprocess.Popen([DCPTOOL, "replay", cap, "--remote", f"sc://127.0.0.1:{srv.port}", "--checksum"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        # the reachability check's connection, then the gRPC client's, which waits for an answer
        _until(lambda: p.poll() is not None or len(srv.accepted) >= 2, timeout=60)
        assert p.poll() is None, p.stderr.read()
        p.send_signal(sig)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        srv.close()
    assert p.returncode == code, err
    assert took < ENDED_WITHIN
    assert "Traceback" not in err.decode()


# --- item 12: --apply on the local engine --------------------------------------------------------

USER_FUNCTIONS = '''
import sys
import pyarrow as pa

def noisy(key, t):
    print("hello from the user function")
    return pa.table({"k": [key], "n": [t.num_rows]})

def leaves(key, t):
    sys.exit(7)

def boom(key, t):
    raise ValueError("boom from the user")
'''


def _user_module(tmp_path):
    (tmp_path / "userfns.py").write_text(USER_FUNCTIONS)


def test_apply_prints_go_to_stderr(tmp_path):
    _user_module(tmp_path)
    cap = _captures(tmp_path / "cap")
    res = subprocess.run([DCPTOOL, "replay", cap, "--apply", "./userfns.py:noisy", "--format", "jsonl"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]   # every stdout line is a result row
    assert rows and all(set(r) == {"k", "n"} for r in rows)
    assert "hello from the user function" in res.stderr


@pytest.mark.parametrize("name, expect", [("leaves", "userfns:leaves tried to exit (SystemExit 7)"),
                                          ("boom", "userfns:boom raised ValueError: boom from the user")])
def test_apply_exit_and_exceptions_are_one_line_naming_the_function(tmp_path, name, expect):
    _user_module(tmp_path)
    cap = _captures(tmp_path / "cap")
    res = subprocess.run([DCPTOOL, "replay", cap, "--apply", f"./userfns.py:{name}"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert res.returncode == 1, res.stderr
    assert expect in _one_error_line(res.stderr)


# --- items 1 and 12: the warm Spark Connect server --------------------------------------------

@pytest.fixture
def warm(warm_server):
    """The environment of a replay on the suite's warm server (tests/support/warm_server.py,
    started here when it is not running)."""
    warm_server.ensure()
    return _env(DCPTOOL_STATE_DIR=warm_server.dir)


@pytest.mark.spark
def test_warm_server_reads_relative_paths_from_the_users_directory(tmp_path, warm):
    _captures(tmp_path / "cap1")
    local = subprocess.run([DCPTOOL, "replay", "cap1", "--table", "documents", "--checksum"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    res = subprocess.run([DCPTOOL, "replay", "cap1", "--spark", "--table", "documents", "--checksum",
                          "-o", "out"], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=warm)
    assert res.returncode == 0, res.stderr
    assert "warm Spark Connect server" in res.stderr
    assert res.stdout == local.stdout and local.stdout
    assert (tmp_path / "out" / "documents.parquet").is_file()


@pytest.mark.spark
def test_warm_server_apply_error_names_the_exception(tmp_path, warm):
    _user_module(tmp_path)
    _captures(tmp_path / "cap1")
    res = subprocess.run([DCPTOOL, "replay", "cap1", "--spark", "--apply", "./userfns.py:boom"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env=warm)
    assert res.returncode == 1, res.stderr
    assert "userfns:boom raised ValueError: boom from the user" in _one_error_line(res.stderr)
