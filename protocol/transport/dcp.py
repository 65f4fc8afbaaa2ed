"""The I/O edge of DCP: an asyncio client connection that feeds the sans-IO consumer
(big reads into a buffer that is handed on with the whole frames it holds, so the bytes of a
busy stream are copied once, by the kernel; writes coalesced; an optional tap that sees every
frame both ways), a session loop that reconnects and resumes
streams, and an asyncio server for the sans-IO producer.

Errors: connection refused, DNS failure, TLS failure and timeouts raise ConnectFailed; a
connection that ends before the consumer is done raises ConnectionLost (after the allowed
reconnects); protocol and auth errors from the consumer propagate as they are.

Timeouts (ConsumerConfig.timeout, `--timeout`): the TCP connect plus TLS handshake, each
request/response step (the consumer's check), and a frame that stops half way (here: the
bytes of one frame must all arrive within the timeout). A step that times out before
streaming starts is ConnectFailed; once streaming, an unanswered request, a half frame or
silence beyond the consumer's idle limit is a dead connection, handled by reconnecting.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import sys
import threading
import time
from typing import Callable, Protocol

import numpy as np

from dcptool.protocol.dcp.client.consumer import Consumer, ConsumerConfig, VbState
from dcptool.protocol.dcp.server.producer import ServerModel, rate_items
from dcptool.protocol.dcp.wire import columnar, sniff
from dcptool.protocol.dcp.wire.constants import DEFAULT_MAX_BODY
from dcptool.protocol.errors import (
    ConnectFailed,
    ConnectionLost,
    ErrorCode,
    ProtocolError,
    RemoteError,
)
from dcptool.protocol.transport.reaper import Reaper

log = logging.getLogger("dcptool.transport.dcp")

READ_BUFFER = 8 * 1024 * 1024    # the largest receive buffer
MIN_READ_BUFFER = 256 * 1024     # the smallest fresh one
# A receive that fills at least this share of its buffer hands the buffer itself on (frames are
# slices of it; the next receive goes into a fresh buffer sized from this one); a smaller one
# is copied out and the buffer kept, so a trickle of small receives never pins a large
# buffer each (what a batch holds is at most 1 / HAND_ON_SHARE of what it pins).
HAND_ON_SHARE = 4
# Buffers handed on are taken back once nothing else holds them (the batches built over them
# are written): fresh memory costs page faults and zeroing in the kernel's copy (the copy
# saved, paid again). At most this many are watched; an older one is left to be freed. The
# store holds 15-20 receives of 16 KiB values at a time (the writer's backlog, the row group
# filling, the encoder's queue), so 8 were all still held when a fresh one was needed.
SPARE_BUFFERS = 16
HANDSHAKE_TIMEOUT = 10.0     # seconds a TLS client has to complete its handshake (serve dcp)


class Tap(Protocol):
    """Sees every frame. `buf` holds whole frames only (at `offsets`, `lengths`) and is never
    written again: keep it, or slices of it. It is bytes or a read-only memoryview (a busy
    stream's receive buffer handed on without a copy): `bytes(buf[a:b])` where a value must be
    bytes."""

    def on_received(self, buf, offsets, lengths, ts_ns: int, mono_ns: int) -> None: ...

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None: ...


def tls_context(ca_cert: str | None = None, insecure: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_cert)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


# --------------------------------------------------------------------------- client

def _tune_socket(transport, rcvbuf: int | None = None) -> None:
    """TCP_NODELAY (DCP is request/response during the handshake), and a larger receive
    buffer where asked (the consumer reads in 8 MiB batches)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    except OSError:
        pass


class ClientProtocol(asyncio.BufferedProtocol):
    """One client connection (what open_connection returns): receives into a buffer, hands
    the whole frames of each receive to the tap and the consumer, writes what the consumer
    asks to send."""

    def __init__(self, consumer: Consumer, tap: Tap | None, on_events: Callable | None,
                 max_body: int = DEFAULT_MAX_BODY):
        self.consumer = consumer
        self.tap = tap
        self.on_events = on_events
        self.max_body = max_body
        self._buf = np.empty(READ_BUFFER, dtype=np.uint8)   # not zeroed: the kernel writes it
        self._lent: list[np.ndarray] = []    # buffers handed on, taken back when free (_spare)
        self._end = 0
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._paused = False
        self._check_handle = None
        self._closed_by_us = False
        self.bytes_in = 0
        self._partial_since: float | None = None   # when the unfinished frame in _buf began

    # ---- asyncio callbacks
    def connection_made(self, transport) -> None:
        self.transport = transport
        _tune_socket(transport, rcvbuf=4 * 1024 * 1024)
        now = time.monotonic()
        try:
            self.consumer.start(now)
            self.flush()
        except BaseException as exc:  # noqa: BLE001 - the tap's output failed (a closed pipe): handed to the session
            self._fail(exc)
            return
        self._schedule_check()

    def get_buffer(self, sizehint: int):
        if self._end >= len(self._buf) - 65536:
            self._renew(2 * len(self._buf), 0)   # a frame larger than the buffer
        return memoryview(self._buf)[self._end:]

    def _renew(self, size: int, start: int) -> None:
        """A fresh buffer of `size` bytes holding what the old one has from `start` on."""
        tail = self._end - start
        fresh = self._spare(max(size, tail + 65536))
        fresh[:tail] = self._buf[start:self._end]
        self._buf, self._end = fresh, tail

    def _spare(self, size: int) -> np.ndarray:
        """A buffer handed on earlier that nothing refers to any more (no view, no batch: only
        this list and the call hold it), at least `size` bytes; else a new one."""
        lent = self._lent
        for i in range(len(lent)):
            if len(lent[i]) >= size and sys.getrefcount(lent[i]) == 2:
                buf = lent[i]
                del lent[i]
                return buf
        return np.empty(size, dtype=np.uint8)   # not zeroed: the kernel writes it

    def buffer_updated(self, nbytes: int) -> None:
        self._end += nbytes
        self.bytes_in += nbytes
        try:
            self._process()
        except BaseException as exc:  # noqa: BLE001 - handed to the session
            self._fail(exc)

    def eof_received(self):
        return False

    def connection_lost(self, exc) -> None:
        if self._check_handle is not None:
            self._check_handle.cancel()
        if not self.done.done():
            # every stream ended (a lag poll may still wait for its answer): a clean end
            if self.consumer.finished or self.consumer.streams.finished or self.consumer.closing or self._closed_by_us:
                self.done.set_result(None)
            else:
                self.done.set_exception(ConnectionLost(
                    f"connection closed by the server{': ' + str(exc) if exc else ''}"))

    # ---- work
    def _process(self) -> None:
        mv = memoryview(self._buf)[:self._end]
        offsets, lengths, consumed, err = columnar.scan(mv, self.max_body)
        del mv
        if consumed:
            chunk = self._take(consumed)
            now = time.monotonic()
            if self.tap is not None:
                self.tap.on_received(chunk, offsets, lengths, time.time_ns(), time.monotonic_ns())
            events = self.consumer.receive(chunk, offsets, lengths, now)
            self.flush()
            if events and self.on_events is not None:
                self.on_events(events)
                self.flush()       # what the handler asked of the consumer (cluster routing)
            if self.consumer.finished and not self.done.done():
                self.done.set_result(None)
        if err is not None:
            raise sniff.first_bytes_error(err, bytes(self._buf[:64]), self.bytes_in == self._end)
        if not self._end:
            self._partial_since = None
        elif consumed or self._partial_since is None:
            self._partial_since = time.monotonic()
        self._maybe_pause()

    def _take(self, consumed: int):
        """The first `consumed` bytes (whole frames), the rest moved to the buffer's start:
        the buffer itself when the receive filled a good share of it (the kernel's copy is
        the only one), else a copy of those bytes."""
        buf = self._buf
        if consumed * HAND_ON_SHARE >= len(buf):
            size = min(READ_BUFFER, max(MIN_READ_BUFFER, 2 * self._end))
            self._renew(size, consumed)
            self._lent.append(buf)
            if len(self._lent) > SPARE_BUFFERS:
                del self._lent[0]
            return memoryview(buf)[:consumed].toreadonly()
        chunk = buf[:consumed].tobytes()
        tail = self._end - consumed
        buf[:tail] = buf[consumed:self._end]   # numpy copies overlapping ranges safely
        self._end = tail
        return chunk

    def flush(self) -> None:
        self.consumer.stamp_sent(time.monotonic())
        frames = self.consumer.outgoing()
        if not frames or self.transport is None or self.transport.is_closing():
            return
        if self.tap is not None:
            ts, mono = time.time_ns(), time.monotonic_ns()
            for f in frames:
                self.tap.on_sent(f, ts, mono)
        self.transport.write(frames[0] if len(frames) == 1 else b"".join(frames))

    def _maybe_pause(self) -> None:
        sp = self.consumer.should_pause
        if sp is None or self._paused:
            return
        if sp():
            self._paused = True
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(0.005, self._unpause)
        elif self.consumer.flush_acks(check_pause=False):
            # the consumer held its ack back at its own look (the queue was full then) and we
            # do not pause: send it now, or a producer blocked on a full window waits for the
            # next periodic check
            self.flush()

    def _unpause(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        sp = self.consumer.should_pause
        if sp is not None and sp():
            asyncio.get_running_loop().call_later(0.005, self._unpause)
            return
        self._paused = False
        self.consumer.flush_acks(check_pause=False)   # we just asked: not paused
        self.flush()
        self.transport.resume_reading()

    def _schedule_check(self) -> None:
        cfg = self.consumer.cfg
        period = min([0.5] + [x / 4 for x in (cfg.noop_interval, cfg.timeout) if x])
        self._check_handle = asyncio.get_running_loop().call_later(period, self._check)

    def _check(self) -> None:
        try:
            now = time.monotonic()
            if not self._paused:   # while we hold reads back, silence is ours, not the server's
                self._check_partial(now)
                self.consumer.check(now)
                if self.consumer.finished and not self.done.done():   # an unanswered last lag poll given up
                    self.done.set_result(None)
                self.consumer.flush_acks()   # an ack held back while paused
                self.flush()
            else:
                self.consumer.hold(now)
                if self._partial_since is not None:
                    self._partial_since = now
        except BaseException as exc:  # noqa: BLE001
            self._fail(exc)
            return
        self._schedule_check()

    def _check_partial(self, now: float) -> None:
        """A frame whose bytes stopped coming: RemoteError(TIMEOUT) after the timeout."""
        timeout = self.consumer.cfg.timeout
        since = self._partial_since
        if not timeout or since is None or now - since <= timeout:
            return
        want = "?"
        if self._end >= 12:
            want = str(24 + int.from_bytes(self._buf[8:12].tobytes(), "big"))
        raise RemoteError(ErrorCode.TIMEOUT, f"a frame stopped half way: {self._end} of {want} bytes "
                          f"arrived, then nothing more for {now - since:.1f} s (--timeout {timeout:g} s)")

    def _fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)
        if self.transport is not None:
            self.transport.close()

    def close(self) -> None:
        self._closed_by_us = True
        if self.transport is not None:
            self.transport.close()


async def open_connection(consumer: Consumer, host: str, port: int, *, tls: ssl.SSLContext | None = None,
                          server_hostname: str | None = None, tap: Tap | None = None,
                          on_events: Callable | None = None, timeout: float = 10.0) -> ClientProtocol:
    loop = asyncio.get_running_loop()
    where = f"{host}:{port}"
    try:
        _, proto = await asyncio.wait_for(
            loop.create_connection(lambda: ClientProtocol(consumer, tap, on_events), host, port, ssl=tls,
                                   server_hostname=(server_hostname or host) if tls else None),
            timeout)
    except ConnectionRefusedError:
        raise ConnectFailed(f"connection refused by {where}: is the server running and the port right?") from None
    except socket.gaierror as exc:
        raise ConnectFailed(f"cannot resolve host {host!r}: {exc.strerror or exc}") from None
    except ssl.SSLCertVerificationError as exc:
        raise ConnectFailed(f"TLS certificate of {where} not trusted: {exc.verify_message or exc.reason}; "
                            "use --ca-cert FILE (or --insecure to skip verification)") from None
    except ssl.SSLError as exc:
        raise ConnectFailed(f"TLS handshake with {where} failed: {exc.reason or exc}") from None
    except (asyncio.TimeoutError, TimeoutError):
        what = "TCP connect and TLS handshake" if tls else "TCP connect"
        raise ConnectFailed(f"timed out connecting to {where} ({what}) after {timeout:g} s "
                            "(--timeout)") from None
    except (ConnectionResetError, ConnectionAbortedError, EOFError) as exc:
        what = "TLS handshake with" if tls else "connection to"
        raise ConnectFailed(f"{what} {where} failed: the server closed the connection ({exc or 'EOF'})") from None
    except OSError as exc:
        raise ConnectFailed(f"cannot connect to {where}: {exc.strerror or exc}") from None
    return proto


class Session:
    """Runs the consumer over one or more TCP connections until it is finished or stopped.
    `conn` counts connections (1 for the first); `resume` restarts streams on reconnect."""

    def __init__(self, cfg: ConsumerConfig, host: str, port: int, *, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, tap: Tap | None = None,
                 on_events: Callable | None = None, on_connect: Callable | None = None,
                 resume: dict[int, VbState] | None = None,
                 should_pause: Callable[[], bool] | None = None, reconnects: int = 3,
                 connect_timeout: float | None = None):
        self.cfg = cfg
        self.host, self.port = host, port
        self.tls, self.server_hostname = tls, server_hostname
        self.tap, self.on_events, self.on_connect = tap, on_events, on_connect
        self.resume = resume
        self.should_pause = should_pause
        self.reconnects = reconnects
        self.connect_timeout = connect_timeout or cfg.timeout or 30.0
        self.conn = 0
        self.consumer: Consumer | None = None
        self._proto: ClientProtocol | None = None
        self._stop: asyncio.Event | None = None
        self.stopped = False

    def stop(self) -> None:
        """Close the streams and end the session (thread-safe within the loop)."""
        self.stopped = True
        if self._stop is not None:
            self._stop.set()

    async def run(self, first: ClientProtocol | None = None) -> Consumer:
        """first: a connection already made (by a cluster session's bootstrap) to continue on."""
        self._stop = asyncio.Event()
        if self.stopped:
            self._stop.set()
        attempts = 0
        while True:
            if first is not None:
                proto, first = first, None
                consumer = self.consumer = proto.consumer
            else:
                self.conn += 1
                consumer = Consumer(self.cfg, self.resume, time.monotonic())
                consumer.should_pause = self.should_pause
                self.consumer = consumer
                if self.on_connect is not None:
                    self.on_connect(self.conn, consumer)
                proto = await open_connection(consumer, self.host, self.port, tls=self.tls,
                                              server_hostname=self.server_hostname, tap=self.tap,
                                              on_events=self.on_events, timeout=self.connect_timeout)
            self._proto = proto
            stop_wait = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({proto.done, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                if self._stop.is_set() and not proto.done.done():
                    await self._close_streams(proto)
                    return consumer
                try:
                    proto.done.result()
                    return consumer
                except (ConnectionLost, RemoteError) as exc:
                    dead = (ErrorCode.DEAD_CONNECTION, ErrorCode.TIMEOUT)
                    if isinstance(exc, RemoteError) and exc.code not in dead:
                        raise
                    progressed = consumer.phase == "streaming"
                    if isinstance(exc, RemoteError) and exc.code == ErrorCode.TIMEOUT and not progressed:
                        # the server accepted the connection but never completed the set-up
                        raise ConnectFailed(f"{self.host}:{self.port}: {exc.message}") from None
                    if not progressed or attempts >= self.reconnects:
                        if isinstance(exc, RemoteError):
                            gave_up = f"; gave up after {attempts} reconnect(s)" if attempts else ""
                            raise ConnectionLost(f"connection lost: {exc.message}{gave_up}") from None
                        raise
                    attempts += 1
                    log.info("connection %d lost (%s); reconnecting", self.conn, exc)
                    self.resume = consumer.resume_state()
                    await asyncio.sleep(min(0.1 * attempts, 1.0))
            finally:
                stop_wait.cancel()
                proto.close()

    async def _close_streams(self, proto: ClientProtocol, wait: float = 1.0) -> None:
        consumer = proto.consumer
        if consumer.phase == "streaming" and not consumer.finished:
            consumer.close_streams()
            proto.flush()
            try:
                await asyncio.wait_for(asyncio.shield(proto.done), wait)
            except (asyncio.TimeoutError, TimeoutError, ConnectionLost, ProtocolError):
                pass
        proto.close()


# --------------------------------------------------------------------------- server

class _ServerProtocol(asyncio.Protocol):
    def __init__(self, server: "ProducerServer", node: int = 0):
        self.server = server
        self.node = node
        self.conn = None
        self.transport = None
        self.wake = asyncio.Event()
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.task = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        _tune_socket(transport)
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)
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

    def connection_lost(self, exc) -> None:
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
        self._reap_task = None
        self.protocols: set[_ServerProtocol] = set()
        self._server = None
        self._servers: list = []
        self._rate_task = None
        self.address: tuple[str, int] | None = None
        self.addresses: list[tuple[str, int]] = []     # one per cluster node (node 0 = address)
        self._seen_changes = (0, 0)

    async def start(self, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None):
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
        await self._server.serve_forever()

    async def close(self) -> None:
        for task in (self._rate_task, self._reap_task):
            if task is not None:
                task.cancel()
        for srv in self._servers:
            srv.close()
        tasks = []
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


class ThreadedServer:
    """A ProducerServer on its own event loop in a daemon thread (tests, benchmarks)."""

    def __init__(self, model: ServerModel, host: str = "127.0.0.1", port: int = 0, rate: float = 0.0,
                 tls: ssl.SSLContext | None = None):
        self.server = ProducerServer(model, rate)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(host, port, tls), daemon=True)
        self._thread.start()
        if not self._ready.wait(30) or self._error is not None:
            raise RuntimeError(f"producer did not start: {self._error}")
        self.host, self.port = self.server.address
        self.addresses = list(self.server.addresses)

    def _run(self, host, port, tls) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start(host, port, tls))
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _shutdown(self) -> None:
        await self.server.close()
        await asyncio.sleep(0)
        # a connection accepted or dropped while closing left a writer behind: end it here,
        # not as "Task was destroyed but it is pending" when the loop closes
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        if rest:
            await asyncio.gather(*rest, return_exceptions=True)
        self.loop.stop()

    def stop(self) -> None:
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
