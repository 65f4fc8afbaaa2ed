"""Issue 39, finding 1: a source pointed at a port where something else listens is one line
naming what answered and what to do, exit 5, for every source scheme. Against real listeners
on 127.0.0.1: a TLS server (Python's ssl, a self-signed certificate made here), redis-server,
`serve dcp` (also refusing a bucket), `serve synapse` and an HTTP server. Before, a TLS port
gave "connection closed by the server" (exit 1), Redis "no answer to HELLO" (exit 3), and
synapse:// printed an HTTP page or Redis errors as replication lines (exit 0)."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import threading

import pytest

from dcptool.protocol.dcp.wire import sniff
from tests.support.cli_util import self_signed_tls
from tests.support.paths import DCPTOOL
from tests.support.pcap_session import Server
from tests.support.synapse_env import RedisServer
from tests.support.synapse_serve import ServeSynapse


class _TlsListener:
    """Accepts connections and runs a TLS handshake on each (a plain client gets reset)."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        conn.settimeout(10)
        try:
            with self.ctx.wrap_socket(conn, server_side=True) as tls:
                tls.recv(64)
        except OSError:
            pass
        finally:
            conn.close()

    def stop(self):
        self.sock.close()


@pytest.fixture(scope="module")
def ports(tmp_path_factory):
    """Every kind of listener, by name: port."""
    d = tmp_path_factory.mktemp("listeners")
    http_srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=http_srv.serve_forever, daemon=True).start()
    tls = _TlsListener(self_signed_tls(d)[0])
    redis = RedisServer(d)
    dcp = Server("dcp", "--items", "10", "--vbuckets", "4")
    synapse = ServeSynapse("--items", "10")
    try:
        yield {"http": http_srv.server_address[1], "tls": tls.port, "redis": redis.port, "dcp": dcp.port,
               "synapse": int(synapse.address.rsplit(":", 1)[1])}
    finally:
        synapse.stop()
        dcp.stop()
        redis.stop()
        tls.stop()
        http_srv.shutdown()
        http_srv.server_close()


def _stream(url: str, most: int = 1) -> tuple[int, str]:
    env = {**os.environ, "DCPTOOL_PASSWORD": "x"}
    r = subprocess.run([DCPTOOL, "stream", url, "--timeout", "5s", "--max-messages", str(most)], capture_output=True,
                       text=True, timeout=120, env=env, stdin=subprocess.DEVNULL)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr     # (stdout: the frames sent)
    return r.returncode, lines[0]


SOURCES = {"couchbase": "couchbase://127.0.0.1:{}/default", "couchbases": "couchbases://127.0.0.1:{}/default",
           "synapse": "synapse://127.0.0.1:{}", "redis": "synapse+redis://127.0.0.1:{}?server_name=hs"}


@pytest.mark.parametrize("scheme, listener, answered, todo", [
    ("couchbase", "tls", "a TLS server answered", "use couchbases://"),
    ("couchbase", "redis", "a Redis server answered", "11210"),
    ("couchbases", "dcp", "a Couchbase data port (memcached binary protocol) answered", "use couchbase://"),
    ("synapse", "http", "an HTTP server answered", "TCP replication listener"),
    ("synapse", "dcp", "a Couchbase data port (memcached binary protocol) answered", "use couchbase://"),
    ("synapse", "redis", "a Redis server answered", "use synapse+redis://"),
    ("synapse", "tls", "a TLS server answered", "synapse+rediss://"),
    ("redis", "http", "an HTTP server answered", "6379"),
    ("redis", "dcp", "a Couchbase data port (memcached binary protocol) answered", "use couchbase://"),
    ("redis", "synapse", "a Synapse replication server answered", "use synapse://"),
    ("redis", "tls", "a TLS server answered", "use synapse+rediss://"),
])
def test_wrong_server_is_named_with_what_to_do(ports, scheme, listener, answered, todo):
    port = ports[listener]
    code, line = _stream(SOURCES[scheme].format(port))
    assert code == 5, line
    assert line.startswith(f"dcptool: 127.0.0.1:{port} is not ") and answered in line and todo in line, line


def test_a_dcp_server_that_refuses_the_bucket(ports):
    code, line = _stream(f"couchbase://127.0.0.1:{ports['dcp']}/nope", 100)
    assert code == 5 and "the DCP server has no bucket 'nope'" in line, line
    assert "case-sensitive" in line and "pools/default/buckets" in line, line


def test_the_right_server_still_streams(ports):
    for url in (f"couchbase://127.0.0.1:{ports['dcp']}/default", f"synapse://127.0.0.1:{ports['synapse']}"):
        r = subprocess.run([DCPTOOL, "stream", url, "--timeout", "5s", "--max-messages", "1", "--format", "jsonl"],
                           capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
        assert r.returncode == 0 and r.stdout, r.stderr


def test_classify_more_first_bytes():
    long_error = b"-ERR unknown command 'NAME', with args beginning with: 'dcptool-127.0.0.1-20377' \r\n"
    assert len(long_error) > 64 and sniff.classify(long_error) == sniff.REDIS
    assert sniff.classify(b"\x81\x0a" + bytes(22)) == sniff.DCP
    assert sniff.wrong_server(sniff.SYNAPSE, "synapse", "h:1") is None       # what it wants
    assert sniff.wrong_first_bytes(b"SERVER hs\n", "synapse", "h:1") is None
