"""The I/O edge for Synapse replication: asyncio TCP (the line protocol) and Redis pub/sub
(redis-py's asyncio client), plus the asyncio loop of the built-in TCP server.

Both client loops drive a sans-IO ``SynapseClient`` and hand every line that crosses the
wire, in either direction, to a ``Handler`` before anything else happens to it, so a capture
sees lines in wire order. Reconnects use exponential back-off; the client keeps its
committed tokens across them, so POSITIONs after a reconnect are checked for gaps.
"""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_mod
import time
from collections.abc import Iterator
from typing import Any, Awaitable, Callable, ParamSpec, Protocol, TypeVar

from dcptool.protocol.dcp.wire import sniff
from dcptool.protocol.errors import (
    ConnectFailed,
    ConnectionLost,
    DcptoolError,
    ErrorCode,
    RemoteError,
)
from dcptool.protocol.synapse import commands as C
from dcptool.protocol.synapse.bulk import Scan, SplitLines, split_lines
from dcptool.protocol.synapse.client import SynapseClient
from dcptool.protocol.synapse.framing import MAX_LINE, LineFramer
from dcptool.protocol.synapse.server import Feed, ServerConnection
from dcptool.protocol.text import printable
from dcptool.protocol.transport import probe
from dcptool.protocol.transport.served import close_served, serve_until_stopped

log = logging.getLogger("dcptool.synapse")

READ_SIZE = 1 << 20

_P = ParamSpec("_P")
_R = TypeVar("_R")


class Handler(Protocol):
    def lines(self, direction: str, lines: list[bytes], split: SplitLines | None, *, conn: int,
              ts_ns: int, mono_ns: int, channel: str | None = None,
              errors: dict[int, str] | None = None) -> None: ...

    def block(self, direction: str, scan: Scan, *, conn: int, ts_ns: int, mono_ns: int,
              channel: str | None = None) -> None: ...

    def events(self, events: list[Any]) -> None: ...   # client events, Reconnecting

    def tick(self) -> None: ...

    def should_stop(self) -> bool: ...

    def paused(self) -> bool: ...


class _HandlerFailed(DcptoolError):
    """An error raised by the handler (a broken stdout, a disk error): never mistaken for a
    lost connection; the original is re-raised."""

    def __init__(self, exc: BaseException):
        super().__init__(str(exc))
        self.exc = exc


def _guard(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """`fn` with its OSErrors (and ValueErrors) wrapped in _HandlerFailed."""
    def call(*a: _P.args, **k: _P.kwargs) -> _R:
        try:
            return fn(*a, **k)
        except (OSError, ValueError) as exc:
            raise _HandlerFailed(exc) from exc
    return call


class _Guarded:
    """The handler, every call into it guarded (_guard)."""

    def __init__(self, handler: Handler):
        self.lines = _guard(handler.lines)
        self.block = _guard(handler.block)
        self.events = _guard(handler.events)
        self.tick = _guard(handler.tick)
        self.should_stop = _guard(handler.should_stop)
        self.paused = _guard(handler.paused)


def _now() -> tuple[int, int]:
    return time.time_ns(), time.monotonic_ns()


def backoff_delay(failures: int, base: float = 0.2, cap: float = 10.0) -> float:
    return min(cap, base * float(2 ** max(0, failures - 1)))


class _Retry:
    """The reconnect policy of both transports: the back-off grows with failures in a row,
    a connection that brought data resets it, and more than max_reconnects gives up."""

    def __init__(self, max_reconnects: int, backoff: Callable[[int], float]):
        self.max_reconnects = max_reconnects
        self.backoff = backoff
        self.failures = 0

    def failed(self, why: str, useful: bool = False) -> float:
        """Count a failure; the delay before the next attempt (raises when giving up)."""
        if useful:
            self.failures = 0
        self.failures += 1
        if self.failures > self.max_reconnects:
            raise ConnectionLost(f"{why} (gave up after {self.failures} attempts)") from None
        return self.backoff(self.failures)


async def _wait_paused(handler: Handler) -> None:
    # the writer is behind: stop reading (TCP back-pressure reaches the server)
    while handler.paused():
        await asyncio.sleep(0.02)


async def run_tcp(host: str, port: int, client: SynapseClient, handler: Handler, *,
                  ssl: ssl_mod.SSLContext | None = None, connect_timeout: float = 10.0,
                  max_reconnects: int = 5, max_line: int = MAX_LINE,
                  tick_interval: float = 0.25, clock: Callable[[], float] = time.monotonic,
                  backoff: Callable[[int], float] = backoff_delay) -> None:
    """Run the TCP line protocol until the handler stops it or an error ends it."""
    try:
        await _run_tcp(host, port, client, _Guarded(handler), ssl=ssl,
                       connect_timeout=connect_timeout, max_reconnects=max_reconnects,
                       max_line=max_line, tick_interval=tick_interval, clock=clock,
                       backoff=backoff)
    except _HandlerFailed as exc:
        raise exc.exc from None


def _connections(handler: Handler) -> Iterator[int]:
    """The numbers of a run's connections (from 1, as in DCP) until the handler says stop."""
    conn_no = 0
    while not handler.should_stop():
        conn_no += 1
        yield conn_no


def _take_in(data: bytes, framer: LineFramer, client: SynapseClient, handler: Handler, conn_no: int,
             now: float) -> None:
    """One read's whole lines to the client and the handler; a framing or client error raised."""
    block = framer.feed_block(data)
    if block:
        ts, mono = _now()
        scan = Scan(block)
        events = client.receive_scan(scan, now)
        handler.block("in", scan, conn=conn_no, ts_ns=ts, mono_ns=mono)
        if events:
            handler.events(events)
    if framer.error is not None:
        ts, mono = _now()
        handler.lines("in", [framer.overlong], None, conn=conn_no, ts_ns=ts,
                      mono_ns=mono, errors={0: framer.error.message + " (truncated)"})
        raise framer.error
    if client.error is not None:
        raise client.error


async def _run_tcp(host: str, port: int, client: SynapseClient, handler: Handler, *,
                   ssl: ssl_mod.SSLContext | None, connect_timeout: float, max_reconnects: int,
                   max_line: int, tick_interval: float, clock: Callable[[], float],
                   backoff: Callable[[int], float]) -> None:
    retry = _Retry(max_reconnects, backoff)
    ever_connected = False
    for conn_no in _connections(handler):
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port, ssl=ssl, limit=max(READ_SIZE, max_line * 2)),
                connect_timeout)
        except (OSError, asyncio.TimeoutError, ssl_mod.SSLError) as exc:
            why = f"cannot connect to synapse://{host}:{port}: {exc or type(exc).__name__}"
            if not ever_connected:
                raise ConnectFailed(why) from None
            delay = retry.failed(why)
            log.info("%s; retrying in %.1f s", why, delay)
            await asyncio.sleep(delay)
            continue
        ever_connected = True
        data_before = client.data_lines
        framer = LineFramer(max_line)
        got_bytes = False

        def send(lines: list[str]) -> None:
            if not lines:
                return
            data = [ln.encode("utf-8") for ln in lines]
            ts, mono = _now()
            handler.lines("out", data, None, conn=conn_no, ts_ns=ts, mono_ns=mono)
            writer.write(b"\n".join(data) + b"\n")
            client.sent(clock())

        try:
            send(client.connect(clock(), time.time_ns() // 1_000_000))
            next_tick = clock() + tick_interval
            while True:
                if handler.should_stop():
                    return
                now = clock()
                deadline = client.next_deadline()
                wake = next_tick if deadline is None else min(deadline, next_tick)
                data: bytes | None
                try:
                    data = await asyncio.wait_for(reader.read(READ_SIZE), max(0.0, wake - now))
                except asyncio.TimeoutError:
                    data = None
                now = clock()
                if data is None:
                    if now >= next_tick:
                        handler.tick()
                        next_tick = now + tick_interval
                    send(client.tick(now, time.time_ns() // 1_000_000))
                    continue
                if not data:
                    tail = framer.eof()
                    if tail:
                        ts, mono = _now()
                        handler.lines("in", [tail], None, conn=conn_no, ts_ns=ts, mono_ns=mono,
                                      errors={0: "connection closed inside this line (no newline)"})
                    raise ConnectionLost(f"synapse://{host}:{port} closed the connection")
                if not got_bytes and conn_no == 1:   # an HTTP or Redis server answers other lines
                    wrong = sniff.wrong_first_bytes(data, "synapse", f"{host}:{port}")
                    if wrong is not None:
                        raise wrong
                got_bytes = True
                _take_in(data, framer, client, handler, conn_no, now)
                if now >= next_tick:
                    handler.tick()
                    next_tick = now + tick_interval
                await _wait_paused(handler)
        except (ConnectionLost, OSError, asyncio.IncompleteReadError) as exc:
            why = str(exc) or type(exc).__name__
        except RemoteError as exc:
            if exc.code != ErrorCode.DEAD_CONNECTION:
                raise
            why = exc.message
        finally:
            client.connection_lost()
            received = client.data_lines > data_before  # a useful connection resets back-off
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (OSError, asyncio.TimeoutError, ssl_mod.SSLError):
                pass
        if conn_no == 1 and not got_bytes:    # not a byte back (a TLS or DCP server): who is it?
            wrong = await probe.wrong_server(host, port, "synapse")
            if wrong is not None:
                raise wrong
        delay = retry.failed(why, useful=received)
        handler.events([Reconnecting(why, delay, conn_no + 1)])
        await asyncio.sleep(delay)


class Reconnecting:
    """Emitted before a reconnect attempt."""
    __slots__ = ("reason", "delay", "conn")

    def __init__(self, reason: str, delay: float, conn: int):
        self.reason, self.delay, self.conn = reason, delay, conn

    def __repr__(self) -> str:
        return f"Reconnecting({self.reason!r}, {self.delay}, {self.conn})"


async def run_redis(host: str, port: int, server_name: str, client: SynapseClient,
                    handler: Handler, *, db: int = 0, password: str | None = None,
                    username: str | None = None, tls: bool = False, ca_cert: str | None = None,
                    insecure: bool = False, connect_timeout: float = 10.0,
                    max_reconnects: int = 5, tick_interval: float = 0.25,
                    clock: Callable[[], float] = time.monotonic,
                    backoff: Callable[[int], float] = backoff_delay) -> None:
    """Subscribe to ``server_name`` and ``server_name/USER_IP`` and record every message.
    The only thing ever published is what ``client.connect`` returns (REPLICATE)."""
    try:
        await _run_redis(host, port, server_name, client, _Guarded(handler), db=db,
                         password=password, username=username, tls=tls, ca_cert=ca_cert,
                         insecure=insecure, connect_timeout=connect_timeout,
                         max_reconnects=max_reconnects, tick_interval=tick_interval,
                         clock=clock, backoff=backoff)
    except _HandlerFailed as exc:
        raise exc.exc from None


async def _redis_subscribe(pubsub: Any, channels: list[str], connect_timeout: float,
                           clock: Callable[[], float], where: str) -> None:
    """Subscribe and wait until every subscription is confirmed before REPLICATE, or the
    POSITION answers could arrive before we listen (Synapse does the same). Refused
    credentials are AuthRefused, other refusals ConnectFailed; connection errors propagate."""
    import redis.exceptions as rexc

    from dcptool.protocol.errors import AuthRefused
    try:
        await pubsub.subscribe(*channels)
        confirmed = 0
        t_end = clock() + connect_timeout
        while confirmed < len(channels):
            msg = await pubsub.get_message(timeout=max(0.01, t_end - clock()))
            if msg is None and clock() > t_end:
                raise rexc.TimeoutError("no SUBSCRIBE confirmation")
            if msg and msg.get("type") == "subscribe":
                confirmed += 1
    except rexc.AuthenticationError as exc:
        raise AuthRefused(f"Redis refused the credentials: {printable(str(exc))}") from None
    except rexc.ResponseError as exc:
        text = printable(str(exc))
        if "NOAUTH" in text or "WRONGPASS" in text or "NOPERM" in text:
            raise AuthRefused(f"Redis refused access: {text}") from None
        raise ConnectFailed(f"Redis at {where}: {text}") from None


def _redis_message(msg: dict[str, Any], client: SynapseClient, handler: Handler, conn_no: int,
                   now: float) -> None:
    """One published message: its lines to the client and the handler (recorded as received)."""
    data = msg["data"]
    if isinstance(data, str):
        data = data.encode("utf-8")
    channel = msg["channel"]
    if isinstance(channel, bytes):
        channel = channel.decode("utf-8", "replace")
    ts, mono = _now()
    lines = [data]
    sp = split_lines(lines)
    events = client.receive(lines, now, sp)
    handler.lines("in", lines, sp, conn=conn_no, ts_ns=ts, mono_ns=mono, channel=channel)
    if events:
        handler.events(events)
    if client.error is not None and client.error.code != ErrorCode.SERVER_ERROR:
        raise client.error


async def _run_redis(host: str, port: int, server_name: str, client: SynapseClient, handler: Handler, *,
                     db: int, password: str | None, username: str | None, tls: bool,
                     ca_cert: str | None, insecure: bool, connect_timeout: float, max_reconnects: int,
                     tick_interval: float, clock: Callable[[], float],
                     backoff: Callable[[int], float]) -> None:
    import redis.asyncio as aioredis
    import redis.exceptions as rexc
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    channels = [server_name, server_name + "/USER_IP"]
    retry = _Retry(max_reconnects, backoff)
    ever_connected = False
    for conn_no in _connections(handler):
        kwargs: dict[str, Any] = dict(host=host, port=port, db=db, password=password, username=username,
                      socket_connect_timeout=connect_timeout, decode_responses=False,
                      retry=Retry(NoBackoff(), 0),  # reconnects are ours, with our back-off
                      client_name="".join(c if c.isprintable() and c != " " else "_" for c in client.name))
        if tls:
            kwargs.update(ssl=True, ssl_ca_certs=ca_cert,
                          ssl_cert_reqs="none" if insecure else "required",
                          ssl_check_hostname=not insecure)
        r = aioredis.Redis(**kwargs)
        pubsub = r.pubsub()
        received = False
        try:
            try:
                await _redis_subscribe(pubsub, channels, connect_timeout, clock, f"{host}:{port}")
            except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
                why = f"cannot connect to Redis at {host}:{port}: {printable(str(exc))}"
                if not ever_connected:   # an HTTP, Synapse, DCP or TLS server there: say which
                    raise (await probe.wrong_server(host, port, "redis") or ConnectFailed(why)) from None
                await asyncio.sleep(retry.failed(why))
                continue
            ever_connected = True
            for line in client.connect(clock(), time.time_ns() // 1_000_000):
                data = line.encode("utf-8")
                ts, mono = _now()
                handler.lines("out", [data], None, conn=conn_no, ts_ns=ts, mono_ns=mono,
                              channel=server_name)
                await r.publish(server_name, data)
            next_tick = clock() + tick_interval
            while True:
                if handler.should_stop():
                    return
                msg = await pubsub.get_message(ignore_subscribe_messages=True,
                                               timeout=max(0.0, next_tick - clock()))
                now = clock()
                if msg is not None and msg.get("type") in ("message", "pmessage"):
                    received = True
                    _redis_message(msg, client, handler, conn_no, now)
                if now >= next_tick:
                    handler.tick()
                    next_tick = now + tick_interval
                await _wait_paused(handler)
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as exc:
            why = f"Redis connection lost: {printable(str(exc))}"
        finally:
            client.connection_lost()
            try:
                # aclose: redis-py >= 5.0.1 (unannotated there), close before
                await getattr(pubsub, "aclose", pubsub.close)()
                await r.aclose() if hasattr(r, "aclose") else await r.close()
            except Exception:  # noqa: BLE001 - closing a broken connection
                pass
        delay = retry.failed(why, useful=received)
        handler.events([Reconnecting(why, delay, conn_no + 1)])
        await asyncio.sleep(delay)


# -- the built-in TCP server ----------------------------------------------------------------

async def read_client_lines(reader: asyncio.StreamReader, framer: LineFramer,
                            write: Callable[[list[str]], None], receive: Callable[[list[bytes]], list[str]],
                            after: Callable[[], Awaitable[None]] | None = None) -> None:
    """The reading half of a served connection: the client's lines go to `receive`, whose
    answer lines are written; a line over the cap is answered with ERROR and ends the
    reading; `after()` (a coroutine function) runs after each read."""
    while True:
        data = await reader.read(65536)
        if not data:
            return
        lines = framer.feed(data)
        if framer.error is not None:
            write([C.format_line(C.Error("line too long"))])
            return
        write(receive(lines))
        if after is not None:
            await after()


async def serve_tcp(bind: str, port: int, make_connection: Callable[[], ServerConnection], feed: Feed, *,
                    on_listening: Callable[[str, int], None],
                    rate: float = 0.0, chunk: int = 2000, drop_after: int | None = None,
                    skip_on_reconnect: int = 0, silent_after: int | None = None,
                    error_after: int | None = None, long_line_after: int | None = None,
                    max_connections: int | None = None, stop: asyncio.Event | None = None,
                    clock: Callable[[], float] = time.monotonic) -> None:
    """Accept replication clients on bind:port. ``make_connection()`` returns a sans-IO
    ``ServerConnection`` bound to the shared ``feed``. Scenario switches (counts are RDATA
    lines sent on one connection): drop_after closes the connection, silent_after stops
    sending anything (PINGs included), error_after sends ERROR and closes, long_line_after
    sends a line over the cap; skip_on_reconnect drops that many feed lines between
    connections (so the next POSITION shows a gap)."""
    state = {"connections": 0}
    stop = stop or asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state["connections"] += 1
        if state["connections"] > 1 and skip_on_reconnect:
            feed.skip(skip_on_reconnect)
        sc = make_connection()
        framer = LineFramer()
        silent = False
        sent_rdata = 0

        def write(lines: list[str]) -> None:
            if lines and not silent:
                writer.write(("\n".join(lines) + "\n").encode("utf-8"))
                sc.sent(clock())

        rt = asyncio.ensure_future(read_client_lines(reader, framer, write, lambda lines: sc.receive(lines, clock()),
                                                     after=writer.drain))
        try:
            write(sc.connect(clock()))
            t0 = clock()
            while not rt.done() and not stop.is_set():
                out, close = sc.tick(clock())
                write(out)
                if close:
                    break
                if silent_after is not None and sent_rdata >= silent_after:
                    silent = True
                if not sc.replicated or feed.done or silent:
                    await asyncio.wait([rt], timeout=0.05)
                    continue
                n = chunk
                if rate > 0:
                    allowed = int((clock() - t0) * rate) - sent_rdata
                    if allowed <= 0:
                        await asyncio.wait([rt], timeout=min(0.05, 1.0 / rate))
                        continue
                    n = min(n, allowed)
                for limit in (drop_after, silent_after, error_after, long_line_after):
                    if limit is not None and sent_rdata < limit:
                        n = min(n, limit - sent_rdata)
                lines = feed.take(n)
                write(lines)
                sent_rdata += len(lines)
                await writer.drain()
                if drop_after is not None and sent_rdata >= drop_after:
                    break
                if error_after is not None and sent_rdata >= error_after:
                    write([C.format_line(C.Error("dcptool serve: scripted error"))])
                    break
                if long_line_after is not None and sent_rdata >= long_line_after:
                    writer.write(b"RDATA events master batch " + b"x" * (sc.max_line + 10) + b"\n")
                    break
        except (ConnectionError, OSError):
            pass
        finally:
            await close_served(writer, rt)

    await serve_until_stopped(handle, bind, port, on_listening, stop)
