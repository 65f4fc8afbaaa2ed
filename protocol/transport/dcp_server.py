"""The I/O edge of the DCP producer: an asyncio server (TCP or TLS, one port per cluster node)
for the sans-IO producer (protocol/dcp/server/producer.py), with live updates at a rate and a
reaper of what closed connections leave behind. The client side is dcp_client.py."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from typing import Any

from dcptool.protocol.dcp.server.producer import ServerModel, rate_items
from dcptool.protocol.transport.reaper import Reaper
from dcptool.protocol.transport.sockets import tune_socket

log = logging.getLogger("dcptool.transport.dcp_server")

HANDSHAKE_TIMEOUT = 10.0     # seconds a TLS client has to complete its handshake (serve dcp)


class _ServerProtocol(asyncio.Protocol):
    def __init__(self, server: "ProducerServer", node: int = 0) -> None:
        self.server = server
        self.node = node
        self.conn: Any = None          # the model's connection (generated or playback): duck-typed
        self.transport: Any = None     # an asyncio transport once connected
        self.wake = asyncio.Event()
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        tune_socket(transport)
        self.transport.set_write_buffer_limits(high=4 * 1024 * 1024)
        model = self.server.model
        # node-aware models (a cluster) learn which node's port the client came to
        self.conn = model.connect(time.monotonic(), self.node) if self.node else model.connect(time.monotonic())
        self.server.protocols.add(self)
        self.task = asyncio.get_running_loop().create_task(self._writer())

    def data_received(self, data: bytes) -> None:
        if self.server.muted(self.node):    # a node that stopped answering (chaos "hang")
            return
        self.conn.receive(data, time.monotonic())
        self.wake.set()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.protocols.discard(self)
        self.server.reaper.gone += 1
        if self.conn is not None:
            self.conn.close(self.conn.closed or "client disconnected")
            log.info("connection %d closed: %s", self.conn.conn_id, self.conn.closed)
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    async def _writer(self) -> None:
        conn = self.conn
        try:
            while True:
                if self.server.muted(self.node):   # silent, the socket left open
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                now = time.monotonic()
                conn.tick(now)
                chunks = conn.pull(now)
                if chunks:
                    self.transport.writelines(chunks)
                self.server.wake_on_topology_change()
                if conn.closed:
                    self.transport.close()   # flushes what is buffered first
                    return
                if chunks:
                    if not self.can_write.is_set():
                        await self.can_write.wait()
                    else:
                        await asyncio.sleep(0)   # let acks and requests in
                    continue
                self.wake.clear()
                deadline = conn.next_deadline()
                timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout)
                except (asyncio.TimeoutError, TimeoutError):
                    pass
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - a producer bug must not kill the server
            log.exception("producer connection failed")
            self.transport.abort()


class ProducerServer:
    """Serves a ServerModel on a TCP (or TLS) port; live updates at `rate` items/s.

    What a client took is given back when it goes (docs/CLI.md, serve dcp): a TLS handshake
    not complete within `handshake_timeout` is closed, and the reaper (reaper.py) collects
    what closed connections left behind and trims the heap."""

    def __init__(self, model: ServerModel, rate: float = 0.0, tick: float = 0.01,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, freeze_heap: bool = False):
        self.model = model
        self.rate = rate
        self.tick = tick
        self.handshake_timeout = handshake_timeout
        self.reaper = Reaper(handshake_timeout, freeze=freeze_heap)   # freeze: the process is ours
        self._reap_task: asyncio.Task[None] | None = None
        self.protocols: set[_ServerProtocol] = set()
        self._server: asyncio.Server | None = None
        self._servers: list[asyncio.Server] = []
        self._rate_task: asyncio.Task[None] | None = None
        self.address: tuple[str, int] | None = None
        self.addresses: list[tuple[str, int]] = []     # one per cluster node (node 0 = address)
        self._seen_changes = (0, 0)

    async def start(self, host: str = "127.0.0.1", port: int = 0,
                    tls: ssl.SSLContext | None = None) -> tuple[str, int]:
        """Listen on host:port, and for a cluster model one more free port per further node
        (spare nodes of --add-node-at included). Returns node 0's address."""
        loop = asyncio.get_running_loop()
        cluster = getattr(self.model, "cluster", None)
        count = len(cluster.nodes) if cluster is not None else 1
        for node in range(count):
            srv = await loop.create_server(lambda n=node: self._protocol(n), host,
                                           port if node == 0 else 0, ssl=tls, reuse_address=True,
                                           ssl_handshake_timeout=self.handshake_timeout if tls is not None else None)
            self._servers.append(srv)
            addr = srv.sockets[0].getsockname()[:2]
            self.addresses.append(addr)
            if hasattr(self.model, "bind_node"):
                self.model.bind_node(node, addr[0], addr[1], addr[1] if tls is not None else None)
        self._server = self._servers[0]
        self.address = self.addresses[0]
        if self.rate > 0:
            self._rate_task = loop.create_task(self._live())
        self.reaper.tls = tls is not None
        self._reap_task = loop.create_task(self.reaper.run())
        return self.address

    def _protocol(self, node: int) -> _ServerProtocol:
        self.reaper.accepted += 1
        return _ServerProtocol(self, node)

    def muted(self, node: int) -> bool:
        cluster = getattr(self.model, "cluster", None)
        return cluster is not None and node in cluster.muted

    def wake_on_topology_change(self) -> None:
        """After a topology event every connection has something to do (stream ends, drops)."""
        changes = (getattr(self.model, "topology_changes", 0), getattr(self.model, "kv_writes", 0))
        if changes != self._seen_changes:   # (KV writes too: their vbuckets' streams send them)
            self._seen_changes = changes
            for p in list(self.protocols):
                p.wake.set()

    async def _live(self) -> None:
        since = time.monotonic()
        carry = 0.0
        buckets = list(self.model.buckets.values())
        while True:
            await asyncio.sleep(self.tick)
            now = time.monotonic()
            n, carry = rate_items(self.rate, since, now, carry)
            since = now
            if n:
                for b in buckets:
                    b.mutate_random(n)
                for p in list(self.protocols):
                    p.wake.set()

    async def serve_forever(self) -> None:
        if self._server is not None:
            await self._server.serve_forever()

    async def close(self) -> None:
        for task in (self._rate_task, self._reap_task):
            if task is not None:
                task.cancel()
        for srv in self._servers:
            srv.close()
        tasks: list[asyncio.Task[None]] = []
        for p in list(self.protocols):
            if p.transport is not None:
                p.transport.abort()
            if p.task is not None:
                p.task.cancel()
                tasks.append(p.task)
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for srv in self._servers:
            await srv.wait_closed()
