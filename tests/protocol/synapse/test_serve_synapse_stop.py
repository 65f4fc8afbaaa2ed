"""`serve synapse` stopped by a signal while clients are connected ends by itself, exit 0, and
prints nothing on stderr: a client replicating, one that stopped reading (its handler blocked
in drain), one that reset its connection, a catch-up (HTTP) client that sent half a request.
Before the fix the held handlers were cancelled at exit and Python 3.11's start_server printed
a CancelledError traceback for each; with a client that did not read, the server never ended."""

from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.integration


def _start(*args: str) -> tuple[subprocess.Popen, tuple[str, int], tuple[str, int]]:
    proc = subprocess.Popen([sys.executable, "-m", "dcptool.cli", "serve", "synapse", "--bind", "127.0.0.1",
                             "--port", "0", "--http-port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, text=True)
    info = json.loads(proc.stdout.readline())
    host, port = info["listening"].rsplit(":", 1)
    hhost, hport = info["http"].rsplit(":", 1)
    return proc, (host, int(port)), (hhost, int(hport))


def _first_line(sock: socket.socket) -> bytes:
    """Bytes up to the first newline (the SERVER line): the server's handler runs."""
    got = b""
    while b"\n" not in got:
        chunk = sock.recv(1)
        assert chunk, "the server closed before its greeting"
        got += chunk
    return got


@pytest.mark.parametrize("items, sig", [("1000", signal.SIGINT), ("0", signal.SIGTERM), ("0", signal.SIGINT)])
def test_a_signal_ends_the_server_with_clients_held(items, sig):
    proc, addr, http = _start("--items", items)
    held = []
    try:
        for mode in ("replicating", "not reading", "reset"):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.settimeout(10)
            s.connect(addr)
            assert _first_line(s).startswith(b"SERVER ")
            s.sendall(b"NAME test\nREPLICATE\n")
            if mode == "reset":
                s.recv(1000)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            else:
                held.append(s)
        half = socket.create_connection(http, timeout=10)
        half.sendall(b"GET /_synapse/replication/get_repl_stream_updates/events?from_token=0")
        held.append(half)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for s in held:
            s.close()
    assert proc.returncode == 0, err
    assert err == "", err
