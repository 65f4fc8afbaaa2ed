"""The I/O edge of the DCP consumer: an asyncio client connection that feeds the sans-IO
consumer (big reads into a buffer that is handed on with the whole frames it holds, so the bytes
of a busy stream are copied once, by the kernel; writes coalesced; an optional tap that sees
every frame both ways), and a session loop that reconnects and resumes streams. The server side
(the producer on a port) is dcp_server.py.

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
import time
from typing import Any, Callable, Protocol, cast

import numpy as np

from dcptool.protocol.dcp.client.consumer import Consumer, ConsumerConfig, VbState
from dcptool.protocol.dcp.wire import columnar, sniff
from dcptool.protocol.dcp.wire.constants import DEFAULT_MAX_BODY
from dcptool.protocol.errors import (
    ConnectFailed,
    ConnectionLost,
    ErrorCode,
    ProtocolError,
    RemoteError,
)
from dcptool.protocol.transport import probe
from dcptool.protocol.transport.sockets import tune_socket

log = logging.getLogger("dcptool.transport.dcp_client")

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
OnEvents = Callable[[list[Any]], None]     # a connection's consumer events, as they come


class Tap(Protocol):
    """Sees every frame. `buf` holds whole frames only (at `offsets`, `lengths`) and is never
    written again: keep it, or slices of it. It is bytes or a read-only memoryview (a busy
    stream's receive buffer handed on without a copy): `bytes(buf[a:b])` where a value must be
    bytes."""

    def on_received(self, buf: Any, offsets: Any, lengths: Any, ts_ns: int, mono_ns: int) -> None: ...

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None: ...


def tls_context(ca_cert: str | None = None, insecure: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=ca_cert)
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class ClientProtocol(asyncio.BufferedProtocol):
    """One client connection (what open_connection returns): receives into a buffer, hands
    the whole frames of each receive to the tap and the consumer, writes what the consumer
    asks to send."""

    def __init__(self, consumer: Consumer, tap: Tap | None, on_events: OnEvents | None,
                 max_body: int = DEFAULT_MAX_BODY):
        self.consumer = consumer
        self.tap = tap
        self.on_events = on_events
        self.max_body = max_body
        self._buf = np.empty(READ_BUFFER, dtype=np.uint8)   # not zeroed: the kernel writes it
        self._lent: list[np.ndarray] = []    # buffers handed on, taken back when free (_spare)
        self._end = 0
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._paused = False
        self._check_handle: asyncio.TimerHandle | None = None
        self._closed_by_us = False
        self.bytes_in = 0
        self._partial_since: float | None = None   # when the unfinished frame in _buf began

    # ---- asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        tune_socket(transport, rcvbuf=4 * 1024 * 1024)
        now = time.monotonic()
        try:
            self.consumer.start(now)
            self.flush()
        except BaseException as exc:  # noqa: BLE001 - the tap's output failed (a closed pipe): handed to the session
            self._fail(exc)
            return
        self._schedule_check()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._end >= len(self._buf) - 65536:
            self._renew(2 * len(self._buf), 0)   # a frame larger than the buffer
        return memoryview(self._buf)[self._end:]  # type: ignore[arg-type]  # numpy arrays are buffers

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

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._check_handle is not None:
            self._check_handle.cancel()
        if not self.done.done():
            # every stream ended (a lag poll may still wait for its answer): a clean end
            streams = self.consumer.streams
            if self.consumer.finished or streams.finished or streams.closing or self._closed_by_us:
                self.done.set_result(None)
            else:
                self.done.set_exception(ConnectionLost(
                    f"connection closed by the server{': ' + str(exc) if exc else ''}"))

    # ---- work
    def _process(self) -> None:
        mv = memoryview(self._buf)[:self._end]  # type: ignore[arg-type]
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
            raise sniff.first_bytes_error(err, bytes(self._buf[:64]), self.bytes_in == self._end, self._peer())
        if not self._end:
            self._partial_since = None
        elif consumed or self._partial_since is None:
            self._partial_since = time.monotonic()
        self._maybe_pause()

    def _peer(self) -> str:
        peer = self.transport.get_extra_info("peername") if self.transport is not None else None
        return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "the server"

    def _take(self, consumed: int) -> bytes | memoryview:
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
            return memoryview(buf)[:consumed].toreadonly()  # type: ignore[arg-type]
        chunk = buf[:consumed].tobytes()
        tail = self._end - consumed
        buf[:tail] = buf[consumed:self._end]   # numpy copies overlapping ranges safely
        self._end = tail
        return chunk

    def flush(self) -> None:
        self.consumer.link.stamp_sent(time.monotonic())
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
            if self.transport is not None:
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
        cfg = self.consumer.link.cfg
        period = min([0.5] + [x / 4 for x in (cfg.noop_interval, cfg.timeout) if x])
        self._check_handle = asyncio.get_running_loop().call_later(period, self._check)

    def _check(self) -> None:
        try:
            now = time.monotonic()
            if not self._paused:   # while we hold reads back, silence is ours, not the server's
                self._check_partial(now)
                try:
                    self.consumer.check(now)
                except RemoteError as exc:
                    # a request's answer that began to arrive and stopped: say so, whichever
                    # deadline the check came to first (the request's is the earlier one)
                    if exc.code == ErrorCode.TIMEOUT and self._partial_since is not None:
                        self._check_partial(now, due=True)
                    raise
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

    def _check_partial(self, now: float, due: bool = False) -> None:
        """A frame whose bytes stopped coming: RemoteError(TIMEOUT) after the timeout (or at
        once when `due`: another deadline of the same wait has passed)."""
        timeout = self.consumer.link.cfg.timeout
        since = self._partial_since
        if not timeout or since is None or (now - since <= timeout and not due):
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
                          on_events: OnEvents | None = None, timeout: float = 10.0) -> ClientProtocol:
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
    except ssl.SSLError as exc:   # a plain server on a couchbases:// port: say which
        raise (await probe.wrong_server(host, port, "couchbases")
               or ConnectFailed(f"TLS handshake with {where} failed: {exc.reason or exc}")) from None
    except (asyncio.TimeoutError, TimeoutError):
        what = "TCP connect and TLS handshake" if tls else "TCP connect"
        raise ConnectFailed(f"timed out connecting to {where} ({what}) after {timeout:g} s "
                            "(--timeout)") from None
    except (ConnectionResetError, ConnectionAbortedError, EOFError) as exc:
        what = "TLS handshake with" if tls else "connection to"
        raise ((await probe.wrong_server(host, port, "couchbases") if tls else None)
               or ConnectFailed(f"{what} {where} failed: the server closed the connection ({exc or 'EOF'})")) from None
    except OSError as exc:
        raise ConnectFailed(f"cannot connect to {where}: {exc.strerror or exc}") from None
    return proto


class Session:
    """Runs the consumer over one or more TCP connections until it is finished or stopped.
    `conn` counts connections (1 for the first); `resume` restarts streams on reconnect."""

    def __init__(self, cfg: ConsumerConfig, host: str, port: int, *, tls: ssl.SSLContext | None = None,
                 server_hostname: str | None = None, tap: Tap | None = None,
                 on_events: OnEvents | None = None, on_connect: Callable[[int, Consumer], None] | None = None,
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
            stop_wait: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
            try:
                either: set[asyncio.Future[Any]] = {proto.done, stop_wait}
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
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
                    progressed = consumer.handshake.streaming
                    if not progressed and not proto.bytes_in and not attempts:   # not a byte back: who is it?
                        wrong = await probe.wrong_server(self.host, self.port, "couchbases" if self.tls else "couchbase")
                        if wrong is not None:
                            raise wrong from None
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
                    self.resume = consumer.streams.resume_state()
                    await asyncio.sleep(min(0.1 * attempts, 1.0))
            finally:
                stop_wait.cancel()
                proto.close()

    async def _close_streams(self, proto: ClientProtocol, wait: float = 1.0) -> None:
        consumer = proto.consumer
        if consumer.handshake.streaming and not consumer.finished:
            consumer.close_streams()
            proto.flush()
            try:
                await asyncio.wait_for(asyncio.shield(proto.done), wait)
            except (asyncio.TimeoutError, TimeoutError, ConnectionLost, ProtocolError):
                pass
        proto.close()
