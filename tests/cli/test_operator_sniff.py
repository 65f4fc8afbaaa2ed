"""Issue 39 (an operator's day), point 1: `stream couchbase://` pointed at a port where something
else listens says what answered and where DCP lives (was `bad magic 0x3c at byte 0`). Against
real listeners on 127.0.0.1: an HTTP server and `serve synapse`; TLS and Redis first bytes by
the classifier alone here (a real TLS server resets the plain connection and redis-server waits
for a newline: those are probed, tests/cli/test_wrong_server.py, with every other scheme)."""

from __future__ import annotations

import http.server
import os
import subprocess
import threading

from dcptool.protocol.dcp.wire import sniff
from tests.support.paths import DCPTOOL
from tests.support.synapse_serve import ServeSynapse


def test_classify_first_bytes():
    assert sniff.classify(b"HTTP/1.0 400 Bad request\r\n") == sniff.HTTP
    assert sniff.classify(b"<!DOCTYPE html>") == sniff.HTTP
    assert sniff.classify(b"SERVER hs1\n") == sniff.SYNAPSE
    assert sniff.classify(b"\x15\x03\x03\x00\x02\x02\x46") == sniff.TLS
    assert sniff.classify(b"-ERR unknown command\r\n") == sniff.REDIS
    assert sniff.classify(b"\x81\x00") is None and sniff.classify(b"") is None


def _stream(port):
    env = {**os.environ, "DCPTOOL_PASSWORD": "x"}
    r = subprocess.run([DCPTOOL, "stream", f"couchbase://127.0.0.1:{port}/default", "--user", "a",
                        "--timeout", "5s"], capture_output=True, text=True, timeout=60, env=env,
                       stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    return r.returncode, lines[0]


def test_http_port():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        code, line = _stream(srv.server_address[1])
    finally:
        srv.shutdown()
        srv.server_close()
    assert code == 5 and "an HTTP server answered" in line and "11210" in line and "11207" in line, line


def test_synapse_port():
    with ServeSynapse() as s:
        code, line = _stream(int(s.address.rsplit(":", 1)[1]))
    assert code == 5 and "a Synapse replication server answered" in line and "synapse://" in line, line
