"""The I/O edge of the DCP producer: an asyncio server (TCP or TLS, one port per cluster node)
for the sans-IO producer (protocol/dcp/server/producer.py), with live updates at a rate and a
reaper of what closed connections leave behind. The client side is dcp_client.py.

What one connection may have queued is bounded, as kv_engine bounds it: requests are answered
one at a time, each answer handed to the socket's write buffer at once; once that buffer holds
more than WRITE_HIGH bytes the peer has not taken, the connection is not read (nor its
requests answered) until the peer drains it below WRITE_LOW. Running out of file descriptors
while accepting is one warning line per ACCEPT_WARN_EVERY seconds (with a count), not a
traceback per attempt; asyncio accepts again when descriptors free up."""

from __future__ import annotations

import asyncio
import errno
import logging
import ssl
import time
from typing import Any, Callable, cast

from dcptool.protocol.dcp.server.producer import (
    ProducerConnection,
    ServerModel,
    rate_items,
)
from dcptool.protocol.dcp.wire.constants import DEFAULT_MAX_BODY
from dcptool.protocol.dcp.wire.frames import split_until_error
from dcptool.protocol.transport.reaper import Reaper
from dcptool.protocol.transport.sockets import tune_socket

log = logging.getLogger("dcptool.transport.dcp_server")

HANDSHAKE_TIMEOUT = 10.0     # seconds a TLS client has to complete its handshake (serve dcp)
WRITE_HIGH = 4 * 1024 * 1024     # queued bytes of one connection above which it is not read
WRITE_LOW = 1024 * 1024          # ... and below which it is read again
ACCEPT_WARN_EVERY = 10.0         # seconds between two "out of file descriptors" warnings
_ACCEPT_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _ServerProtocol(asyncio.Protocol):
    def __init__(self, server: "ProducerServer", node: int = 0) -> None:
        self.server = server
        self.node = node
        self.conn: ProducerConnection | None = None
        self.transport: asyncio.Transport | None = None
        self.wake = asyncio.Event()
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.task: asyncio.Task[None] | None = None
        self.inbox = bytearray()        # received, not yet answered (whole requests and a partial one)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)   # a stream server's (TCP, TLS): a Transport
        tune_socket(transport)
        self.transport.set_write_buffer_limits(high=WRITE_HIGH, low=WRITE_LOW)
        model = self.server.model
        # node-aware models (a cluster) learn which node's port the client came to
        self.conn = model.connect(time.monotonic(), self.node) if self.node else model.connect(time.monotonic())
        self.server.protocols.add(self)
        self.task = asyncio.get_running_loop().create_task(self._writer())

    def data_received(self, data: bytes) -> None:
        if self.server.muted(self.node):    # a node that stopped answering (chaos "hang")
            return
        self.inbox += data
        self._answer_inbox()

    def _answer_inbox(self) -> None:
        """Hand the producer the whole requests received, one at a time, gathering their
        answers; stop taking requests once the answers the peer has not read (the transport's
        buffer and those gathered) pass WRITE_HIGH. pause_writing then stops reading too, and
        resume_writing comes back here. A bad header goes to the producer with what follows
        it: it closes the connection with its own message."""
        conn, inbox, transport = self.conn, self.inbox, self.transport
        if conn is None or transport is None or conn.closed:
            inbox.clear()
            return
        while True:
            bounds, used, err = split_until_error(inbox, DEFAULT_MAX_BODY)
            now = time.monotonic()
            held = transport.get_write_buffer_size()
            out: list[Any] = []
            done, full = 0, False
            for off, length in bounds:
                if held > WRITE_HIGH or not self.can_write.is_set() or conn.closed:
                    full = True
                    break
                conn.receive(bytes(inbox[off:off + length]), now)
                done = off + length
                if conn.wants_write:      # its answers only: stream data is the writer task's
                    chunks = conn.pull(now, 0)
                    out += chunks
                    held += sum(map(len, chunks))
            else:
                if err is not None and not conn.closed:
                    conn.receive(bytes(inbox[used:]), now)
                    done = len(inbox)
            del inbox[:done]
            self._write(out)
            # stopped at the bound, but the socket took enough at once: go on with the rest
            if not full or not done or not inbox or conn.closed or not self.can_write.is_set():
                break
        self.wake.set()

    def _write(self, chunks: list[Any]) -> None:
        transport = self.transport
        if chunks and transport is not None:
            transport.writelines(chunks)
            queued = transport.get_write_buffer_size()
            if queued > self.server.peak_queued:
                self.server.peak_queued = queued

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.protocols.discard(self)
        self.server.reaper.gone += 1
        if self.conn is not None:
            self.conn.close(self.conn.closed or "client disconnected")
            log.info("connection %d closed: %s", self.conn.conn_id, self.conn.closed)
        if self.task is not None:
            self.task.cancel()

    def pause_writing(self) -> None:
        """The peer leaves more than WRITE_HIGH bytes unread: read nothing more from it."""
        self.can_write.clear()
        self.server.read_pauses += 1
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        """Below WRITE_LOW again: answer what was held back, then read again."""
        self.can_write.set()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._answer_inbox()
        if self.can_write.is_set():
            transport.resume_reading()

    async def _writer(self) -> None:
        conn, transport = self.conn, self.transport
        assert conn is not None and transport is not None, "started by connection_made"
        try:
            while True:
                if self.server.muted(self.node):   # silent, the socket left open
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                now = time.monotonic()
                conn.tick(now)
                if self.inbox and self.can_write.is_set():   # requests held back at the bound
                    self._answer_inbox()
                chunks = conn.pull(now)
                self._write(chunks)
                self.server.wake_on_topology_change()
                if conn.closed:
                    transport.close()   # flushes what is buffered first
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
            transport.abort()


class ProducerServer:
    """Serves a ServerModel on a TCP (or TLS) port; live updates at `rate` items/s.

    What a client took is given back when it goes (docs/CLI.md, serve dcp): a TLS handshake
    not complete within `handshake_timeout` is closed, and the reaper (reaper.py) collects
    what closed connections left behind and trims the heap."""

    def __init__(self, model: ServerModel, rate: float = 0.0, tick: float = 0.01,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT, freeze_heap: bool = False,
                 on_warning: Callable[[str], None] | None = None):
        self.model = model
        self.on_warning = on_warning or log.warning     # one line (serve dcp: on stderr)
        self.peak_queued = 0            # the most bytes one connection had queued for its peer
        self.read_pauses = 0            # times a connection was not read because of it
        self.accept_failures = 0        # accepts that found no file descriptor (all told)
        self._accept_unreported = 0
        self._accept_warned: float | None = None
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
        if loop.get_exception_handler() is None:
            loop.set_exception_handler(self._loop_exception)
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

    def _loop_exception(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        """asyncio's accept loop out of file descriptors (it says so and retries a second later,
        once per listening socket and attempt): counted, and one warning line at most every
        ACCEPT_WARN_EVERY seconds. Anything else goes to asyncio's own handler."""
        exc = context.get("exception")
        if not (isinstance(exc, OSError) and exc.errno in _ACCEPT_ERRNOS
                and "accept" in str(context.get("message", ""))):
            loop.default_exception_handler(context)
            return
        self.accept_failures += 1
        self._accept_unreported += 1
        now = time.monotonic()
        if self._accept_warned is not None and now - self._accept_warned < ACCEPT_WARN_EVERY:
            return
        first = self._accept_warned is None
        self._accept_warned = now
        n, self._accept_unreported = self._accept_unreported, 0
        since = "" if first else f" in the last {ACCEPT_WARN_EVERY:g} s"
        self.on_warning(f"warning: out of file descriptors ({exc.strerror or exc}): accepting a connection "
                        f"failed {n} time(s){since}; waiting connections are accepted when descriptors free up "
                        "(raise the limit: ulimit -n)")

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
