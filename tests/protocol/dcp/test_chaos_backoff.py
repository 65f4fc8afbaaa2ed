"""A cluster capture's reconnect backoff (protocol/transport/dcp_cluster.py) starts again
from its first step once the node serves again: a node whose connections drop again and
again, each time after the capture reconnected, is retried after 0.2 s every time, so a short
`--timeout` never expires a vbucket the node serves again within it. (Before the fix the
backoff kept doubling across successful reconnects: the fourth drop waited 1.6 s, past a 1.5 s
`--timeout`, and the capture exited 1 naming node 1's vbuckets.)"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

from dcptool.protocol.dcp.server import producer as P
from tests.support.paths import DCPTOOL
from tests.support.threaded_server import ThreadedServer

BOUND = 15
DROPS = 5


def _on_loop(srv, fn):
    async def call():
        return fn()
    return asyncio.run_coroutine_threadsafe(call(), srv.loop).result(BOUND)


def _streaming(srv, node: int) -> set[int]:
    """The connections to `node` that have streams open (asked on the server's loop)."""
    return _on_loop(srv, lambda: {p.conn.conn_id for p in srv.server.protocols
                                  if p.conn is not None and p.conn.node == node and p.conn.streams
                                  and not p.conn.closed})


def _drop(srv, node: int) -> None:
    def go():
        for p in list(srv.server.protocols):
            if p.conn is not None and p.conn.node == node:
                p.conn.close("test: dropped")
                p.wake.set()
    _on_loop(srv, go)


def test_the_backoff_starts_again_after_a_successful_reconnect(tmp_path):
    model = P.server_from_options(vbuckets=16, items=200, seed=5, nodes=3, replicas=1)
    with ThreadedServer(model) as srv:
        url = f"couchbase://{srv.host}:{srv.port}/default"
        proc = subprocess.Popen([DCPTOOL, "capture", url, "-o", str(tmp_path / "c"), "--quiet",
                                 "--timeout", "1500ms", "--noop-interval", "1s", "--to", "forever"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            seen: set[int] = set()
            for drop in range(DROPS + 1):
                deadline = time.monotonic() + BOUND
                while True:      # the capture streams from node 1 on a connection not dropped yet
                    now = _streaming(srv, 1) - seen
                    if now or proc.poll() is not None:
                        break
                    assert time.monotonic() < deadline, f"no stream on node 1 after drop {drop}"
                    time.sleep(0.01)
                assert proc.poll() is None, f"the capture ended after {drop} drops: {proc.stderr.read()}"
                seen |= now
                if drop < DROPS:
                    _drop(srv, 1)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=BOUND)
    assert proc.returncode == 143, err
    assert "could not be served" not in err
