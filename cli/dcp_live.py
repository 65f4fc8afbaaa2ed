"""`dcptool stream couchbase://...`: runs the DCP consumer (protocol/dcp/consumer.py) over
the asyncio transport (protocol/transport/dcp.py) and prints every frame that crosses the
wire, both directions, as CAPTURE_FORMAT rows plus `direction` and `ts`.

Mutation frames (the bulk of any stream) take a direct row builder that gives exactly the
dict messages.to_row gives (tests/test_dcp_live.py checks it); every other frame is
decoded with the codec.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import datetime
import os
import signal
import struct
import time

from dcptool.cli.console import err_console
from dcptool.cli.errors import Interrupted
from dcptool.cli.live import LiveOptions
from dcptool.cli.output import Sink, default_format
from dcptool.protocol.dcp import consumer as C
from dcptool.protocol.dcp import messages as m
from dcptool.protocol.dcp.constants import status_name, stream_end_reason_name
from dcptool.protocol.dcp.frames import parse_frame
from dcptool.protocol.errors import ErrorCode, RemoteError

TABLE_COLUMNS = ["conn", "direction", "op", "vbucket", "status", "opaque", "by_seqno", "key", "value_len",
                 "snap_start", "snap_end", "snap_flags", "stream_end_reason", "rollback_seqno"]

_MUT = struct.Struct(">BBHBBHIIQQQIII")   # header + mutation extras up to lock_time
# Knobs tests turn down.
DEFAULTS = {"reconnects": 3, "connect_timeout": 10.0}


def run_capture(opts: LiveOptions, settings: dict):
    """`dcptool capture couchbase://...` lives in cli/dcp_capture.py."""
    from dcptool.cli.dcp_capture import run_capture as _run
    return _run(opts, settings)


def consumer_config(opts: LiveOptions) -> C.ConsumerConfig:
    src = opts.source
    return C.ConsumerConfig(
        bucket=src.bucket, name=opts.name or f"dcptool-{src.host}-{os.getpid()}", user=opts.user,
        password=opts.password, vbuckets=opts.vbuckets, start=opts.from_, to=opts.to,
        no_value=opts.no_value, xattrs=opts.xattrs, collections=opts.collections,
        buffer_size=opts.buffer_size, noop_interval=opts.noop_interval, tls=src.tls,
        allow_plain=opts.sasl_plain)


def tls_for(opts: LiveOptions):
    if not opts.source.tls:
        return None
    from dcptool.protocol.transport.dcp import tls_context
    return tls_context(opts.ca_cert, opts.insecure)


def iso_ns(ts_ns: int) -> str:
    sec, ns = divmod(ts_ns, 1_000_000_000)
    return datetime.datetime.fromtimestamp(sec, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S") + f".{ns:09d}Z"


class RowTap:
    """Turns every frame into a row for the sink; stops after max_messages received."""

    def __init__(self, sink: Sink, *, values: bool, raw: bool, b64: bool, max_messages: int | None,
                 on_limit=None):
        self.sink = sink
        self.values = values
        self.raw = raw
        self.b64 = b64          # jsonl: keys as base64 text right away (no per-row fallback)
        self.remaining = max_messages
        self.on_limit = on_limit
        self.consumer: C.Consumer | None = None
        self.conn = 0
        self.received = 0
        self.sent = 0

    def attach(self, conn: int, consumer: C.Consumer) -> None:
        self.conn, self.consumer = conn, consumer

    def _vb_of(self, opaque: int):
        return self.consumer.vb_opaque.get(opaque) if self.consumer is not None else None

    def row(self, buf, off: int, ln: int, ts: str, direction: str) -> dict:
        if (buf[off + 1] == 0x57 and buf[off] == 0x80 and buf[off + 4] == 31
                and not (self.consumer is not None and self.consumer.collections)):
            magic, op, kl, _el, dt, vb, bl, opq, cas, by, rev, fl, exp, lock = _MUT.unpack_from(buf, off)
            ks = off + 55
            key = buf[ks:ks + kl]
            row = {"ts": ts, "conn": self.conn, "direction": direction, "magic": magic, "opcode": op,
                   "op": "mutation", "vbucket": vb, "opaque": opq, "cas": cas, "datatype": dt,
                   "key": key, "value_len": bl - 31 - kl, "by_seqno": by, "rev_seqno": rev,
                   "item_flags": fl, "expiration": exp, "lock_time": lock}
            if self.values:
                row["value"] = buf[ks + kl:off + ln]
        else:
            msg = m.decode(parse_frame(buf, off, ln), self.consumer.collections if self.consumer else False)
            row = {"ts": ts, "conn": self.conn, "direction": direction}
            row.update(m.to_row(msg, value=self.values))
            if msg.IS_RESPONSE:
                vb = self._vb_of(msg.opaque)
                if vb is not None:
                    row["vbucket"] = vb
        if self.raw:
            raw = bytes(buf[off:off + ln])
            if raw[1] in (0x21, 0x22) and raw[0] == 0x80:   # SASL: credentials become '*' bytes
                vstart = 24 + raw[4] + int.from_bytes(raw[2:4], "big")
                raw = raw[:vstart] + b"*" * (len(raw) - vstart)
            row["raw"] = raw
        if self.b64:
            for k in ("key", "value", "raw"):
                v = row.get(k)
                if v is not None and type(v) is not str:
                    row[k] = base64.b64encode(v).decode("ascii")
        return row

    def on_received(self, buf, offsets, lengths, ts_ns: int, mono_ns: int) -> None:
        if self.remaining is not None and self.remaining <= 0:
            return
        offs, lens = offsets.tolist(), lengths.tolist()
        if self.remaining is not None and len(offs) > self.remaining:
            offs, lens = offs[:self.remaining], lens[:self.remaining]
        ts = iso_ns(ts_ns)
        conn = self.conn
        fast = not (self.consumer is not None and self.consumer.collections) and not self.values and not self.raw
        b64 = self.b64
        unpack = _MUT.unpack_from
        enc = binascii.b2a_base64
        rows = []
        append = rows.append
        for off, ln in zip(offs, lens):
            if fast and buf[off + 1] == 0x57 and buf[off] == 0x80 and buf[off + 4] == 31:
                # the hot path: the same dict as to_row(decode(frame)), built directly
                magic, op, kl, _el, dt, vb, bl, opq, cas, by, rev, fl, exp, lock = unpack(buf, off)
                key = buf[off + 55:off + 55 + kl]
                append({"ts": ts, "conn": conn, "direction": "in", "magic": magic, "opcode": op,
                        "op": "mutation", "vbucket": vb, "opaque": opq, "cas": cas, "datatype": dt,
                        "key": enc(key, newline=False).decode("ascii") if b64 else key,
                        "value_len": bl - 31 - kl, "by_seqno": by, "rev_seqno": rev,
                        "item_flags": fl, "expiration": exp, "lock_time": lock})
            else:
                append(self.row(buf, off, ln, ts, "in"))
        self.sink.write_many(rows)
        self.received += len(offs)
        if self.remaining is not None:
            self.remaining -= len(offs)
            if self.remaining <= 0 and self.on_limit is not None:
                self.on_limit()

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        if self.remaining is not None and self.remaining <= 0:
            return
        self.sent += 1
        self.sink.write(self.row(frame, 0, len(frame), iso_ns(ts_ns), "out"))


class EventLog:
    """Consumer events as one line each on stderr."""

    def __init__(self, quiet: bool = False):
        self.console = err_console()
        self.quiet = quiet
        self.failed: dict[int, int] = {}
        self.rollbacks = 0
        self.ends: dict[int, int] = {}

    def __call__(self, events) -> None:
        for e in events:
            t = type(e)
            if t is C.ControlRefused:
                self._say(f"[yellow]DCP_CONTROL {e.key}={e.value} refused[/] ({status_name(e.status)}); continuing")
            elif t is C.Rollback:
                self.rollbacks += 1
                self._say(f"vbucket {e.vbucket}: ROLLBACK to seqno {e.seqno}; re-requesting")
            elif t is C.StreamFailed:
                self.failed[e.vbucket] = e.status
                if e.status != 0x07 or len(self.failed) <= 3:
                    self._say(f"[yellow]vbucket {e.vbucket}: stream request failed[/] ({status_name(e.status)})")
            elif t is C.StreamEnded:
                self.ends[e.vbucket] = e.reason
                if e.reason and e.reason != 1:   # 1: closed because we asked
                    again = "" if e.final else "; re-requesting"
                    self._say(f"vbucket {e.vbucket}: stream end ({stream_end_reason_name(e.reason)}){again}")

    def _say(self, text: str) -> None:
        if not self.quiet:
            self.console.print(text, highlight=False)


def run_session(session, duration: float | None, signals=(signal.SIGINT,)):
    """Run a transport Session on a fresh event loop until it ends, `duration` passes, or a
    signal asks it to close its streams: (consumer, interrupted by a signal)."""
    interrupted = False

    async def main():
        loop = asyncio.get_running_loop()

        def on_signal():
            nonlocal interrupted
            interrupted = True
            session.stop()
        installed = []
        for sig in signals:
            try:
                loop.add_signal_handler(sig, on_signal)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass
        if duration:
            loop.call_later(duration, session.stop)
        try:
            return await session.run()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    consumer = asyncio.run(main())
    return consumer, interrupted


def run_stream(opts: LiveOptions) -> None:
    from dcptool.protocol.transport.dcp import Session

    fmt = default_format(opts.fmt)
    sink = Sink(fmt, columns=TABLE_COLUMNS if fmt in ("table",) else None)
    events = EventLog()
    session_box: dict = {}

    def stop():
        s = session_box.get("session")
        if s is not None:
            s.stop()

    tap = RowTap(sink, values=opts.values, raw=opts.raw, b64=fmt == "jsonl", max_messages=opts.max_messages,
                 on_limit=stop)
    session = Session(consumer_config(opts), opts.source.host, opts.source.port, tls=tls_for(opts),
                      tap=tap, on_events=events, on_connect=tap.attach, reconnects=DEFAULTS["reconnects"],
                      connect_timeout=DEFAULTS["connect_timeout"])
    session_box["session"] = session
    started = time.monotonic()
    try:
        consumer, interrupted = run_session(session, opts.duration)
    finally:
        sink.close()
    if interrupted:
        raise Interrupted()
    elapsed = time.monotonic() - started
    if consumer is not None:
        err_console().print(
            f"{tap.received} frames received, {consumer.data_frames} items, "
            f"{len(events.ends)} streams ended, {events.rollbacks} rollbacks, "
            f"{session.conn} connection(s), {elapsed:.2f} s", highlight=False, style="dim", soft_wrap=True)
        opened = set(events.ends) | {vb for vb in consumer.states if vb not in events.failed}
        if events.failed and not opened and not session.stopped:
            status = next(iter(events.failed.values()))
            raise RemoteError(ErrorCode.STATUS, f"every stream request failed, e.g. vbucket "
                              f"{next(iter(events.failed))}: {status_name(status)}", status)
