"""`dcptool capture couchbase://...`: the DCP consumer over the asyncio transport, with a
tap that turns every receive batch into one Arrow record batch (protocol/dcp/columnar.py
-> replay/dcp_batch.py) for the background Parquet writer. Frames we send are recorded
too (SASL payloads masked by the writer). When the writer's queue is long the consumer
stops acknowledging buffers, so the producer's flow control slows it and nothing is lost.
"""

from __future__ import annotations

import signal
import time

import numpy as np

from dcptool.cli.console import err_console
from dcptool.cli.errors import Interrupted
from dcptool.cli.live import LiveOptions
from dcptool.cli.process import fewer_gc_passes, without_pandas
from dcptool.protocol.dcp import columnar
from dcptool.protocol.dcp import consumer as C

# Knobs tests turn down.
DEFAULTS = {"reconnects": 5, "connect_timeout": 10.0, "pause_backlog_bytes": 32 * 2**20}


class CaptureTap:
    """Receives every frame from the transport and hands Arrow batches to the writer."""

    def __init__(self, bg, progress, *, max_messages: int | None = None, on_limit=None):
        from dcptool.replay.dcp_batch import to_record_batch
        self._to_batch = to_record_batch
        self.bg = bg
        self.progress = progress
        self.frame_no = 0
        self.conn = 0
        self.consumer: C.Consumer | None = None
        self.opaque_vb: dict[int, int] = {}
        self.received = 0
        self.wire_bytes = 0
        self.remaining = max_messages
        self.on_limit = on_limit
        self._held: list | None = []    # batches held until the options metadata is final
        self._out: list = []            # sent frames not yet in a batch: (frame_no, frame, ts, mono)
        self._next_progress = 0.0

    # -- transport hooks
    def attach(self, conn: int, consumer: C.Consumer) -> None:
        self._flush_out()
        self.conn, self.consumer = conn, consumer

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        self._out.append((self.frame_no, frame, ts_ns, mono_ns))
        self.frame_no += 1

    def on_received(self, buf, offsets, lengths, ts_ns: int, mono_ns: int) -> None:
        self._flush_out()
        n = len(offsets)
        if n == 0:
            return
        collections = self.consumer.collections if self.consumer is not None else False
        batch = columnar.decode_batch(buf, offsets, lengths, collections=collections,
                                      opaque_vbuckets=self.opaque_vb)
        rb = self._to_batch(batch, frame_no=np.arange(self.frame_no, self.frame_no + n, dtype=np.int64),
                            conn=self.conn, ts_ns=np.full(n, ts_ns, dtype=np.int64),
                            mono_ns=np.full(n, mono_ns, dtype=np.int64), direction=np.zeros(n, dtype=np.uint8))
        self.frame_no += n
        self.received += n
        nbytes = int(lengths.sum())
        self.wire_bytes += nbytes
        self._submit(rb)
        self.progress.add(frames=n, wire_bytes=nbytes)
        now = time.monotonic()
        if now >= self._next_progress:
            self._next_progress = now + 0.25
            self._progress_details()
        if self.remaining is not None:
            self.remaining -= n
            if self.remaining <= 0 and self.on_limit is not None:
                self.on_limit()

    # -- batches
    def release(self) -> None:
        """The options metadata is final: everything held goes to the writer."""
        held, self._held = self._held, None
        for rb in held or ():
            self.bg.submit(rb)

    def _submit(self, rb) -> None:
        if self._held is not None:
            self._held.append(rb)
        else:
            self.bg.submit(rb)

    def _flush_out(self) -> None:
        if not self._out:
            return
        out, self._out = self._out, []
        buf = b"".join(f for _, f, _, _ in out)
        lengths = np.array([len(f) for _, f, _, _ in out], dtype=np.int64)
        offsets = np.zeros(len(out), dtype=np.int64)
        np.cumsum(lengths[:-1], out=offsets[1:])
        collections = self.consumer.collections if self.consumer is not None else False
        batch = columnar.decode_batch(buf, offsets, lengths, collections=collections, opaque_vbuckets=self.opaque_vb)
        rb = self._to_batch(batch, frame_no=np.array([x[0] for x in out], dtype=np.int64), conn=self.conn,
                            ts_ns=np.array([x[2] for x in out], dtype=np.int64),
                            mono_ns=np.array([x[3] for x in out], dtype=np.int64),
                            direction=np.ones(len(out), dtype=np.uint8))
        self._submit(rb)

    def finish(self) -> None:
        self._flush_out()
        self.release()

    def _progress_details(self) -> None:
        c = self.consumer
        if c is None:
            return
        ended = sum(1 for s in c.states.values() if s.ended_reason is not None)
        self.progress.update(streams_open=max(0, len(c.states) - ended), streams_ended=ended,
                             positions={vb: s.last_seqno for vb, s in c.states.items()},
                             bytes_written=self.bg.writer.bytes_written, backlog_bytes=self.bg.backlog_bytes)


def resume_from(directory: str) -> tuple[dict[int, C.VbState], list[str]]:
    """Per-vbucket state recorded by earlier captures in directory (finishing any segment a
    killed capture left in progress first)."""
    import os

    from dcptool.replay.reader import find_captures
    from dcptool.replay.resume import dcp_resume_state, recover_in_progress
    if not os.path.isdir(directory):
        return {}, []
    recovered = recover_in_progress(directory)
    files = [f for f in find_captures([directory]) if f.protocol == "dcp"] if any(
        n.endswith((".parquet", ".arrows")) for n in os.listdir(directory)) else []
    if not files:
        return {}, recovered
    state = {}
    for vb, r in dcp_resume_state(files).items():
        if not r.failover_log and not r.last_seqno:
            continue
        # a stream that reached its end continues from there: the new run's end is later
        state[vb] = C.VbState(failover_log=list(r.failover_log), last_seqno=r.last_seqno,
                              snap_start=r.snap_start, snap_end=r.snap_end,
                              snapshot_complete=r.snapshot_complete)
    return state, recovered


def run_capture(opts: LiveOptions, settings: dict) -> None:
    without_pandas()
    from dcptool.cli.dcp_live import EventLog, consumer_config, run_session, tls_for
    from dcptool.cli.progress import make_progress, print_summary
    from dcptool.protocol.transport.dcp import Session
    from dcptool.replay.writer import BackgroundWriter, CaptureWriter, WriterError

    out = settings["output"]
    resume, recovered = resume_from(out) if settings.get("resume") else ({}, [])
    if settings.get("resume"):
        err_console().print(f"resuming {len(resume)} vbuckets from the captures in {out}"
                            + (f" (finished {len(recovered)} in-progress segment(s))" if recovered else ""),
                            highlight=False)
    options = opts.safe_dict()
    options["resumed_vbuckets"] = len(resume)
    progress = make_progress("dcp", quiet=settings.get("quiet", False))
    events = EventLog(quiet=settings.get("quiet", False))
    box: dict = {}

    def stop():
        s = box.get("session")
        if s is not None:
            s.stop()

    writer = bg = tap = None
    handshake: dict = {}

    def on_events(evs):
        events(evs)
        for e in evs:
            if type(e) is C.HandshakeComplete and tap._held is not None:
                handshake.update(features=list(e.features), controls=dict(e.controls))
                full = dict(options, hello_features=[f"0x{f:02x}" for f in e.features], dcp_controls=e.controls)
                writer.set_options(full)
                tap.release()
        if bg.error is not None:
            stop()

    try:
        writer = CaptureWriter(out, "dcp", source=opts.source.url, options=options,
                               compression=settings.get("compression", "zstd"),
                               rotate_size=settings.get("rotate_size", 256 * 2**20),
                               rotate_interval=settings.get("rotate_interval", 300.0))
    except WriterError:
        progress.close()
        raise
    bg = BackgroundWriter(writer)
    fewer_gc_passes()
    tap = CaptureTap(bg, progress, max_messages=opts.max_messages, on_limit=stop)
    pause_at = DEFAULTS["pause_backlog_bytes"]
    session = Session(consumer_config(opts), opts.source.host, opts.source.port, tls=tls_for(opts),
                      tap=tap, on_events=on_events, on_connect=tap.attach, resume=resume or None,
                      should_pause=lambda: bg.backlog_bytes > pause_at or bg.error is not None,
                      reconnects=DEFAULTS["reconnects"], connect_timeout=DEFAULTS["connect_timeout"])
    box["session"] = session
    started = time.monotonic()
    error: BaseException | None = None
    consumer, interrupted = None, False
    try:
        consumer, interrupted = run_session(session, opts.duration, (signal.SIGINT, signal.SIGTERM))
    except BaseException as exc:  # noqa: BLE001 - the files are closed first, then it is re-raised
        error = exc
    finally:
        progress.close()
        tap.finish()
    try:
        files = bg.close()
    except WriterError as exc:
        raise exc from None
    if bg.error is not None and error is None:
        error = bg.error
    extra = {"capture_id": writer.capture_id, "frames": tap.frame_no, "received": tap.received,
             "connections": session.conn, "rollbacks": events.rollbacks,
             "streams_ended": len(events.ends), "seconds": round(time.monotonic() - started, 3)}
    if recovered:
        extra["recovered_segments"] = recovered
    if files or error is None:
        print_summary(files, json_summary=settings.get("json_summary", False),
                      quiet=settings.get("quiet", False), extra=extra)
    if error is not None:
        raise error
    if interrupted:
        raise Interrupted()
    if consumer is not None and events.failed and not events.ends and not session.stopped:
        from dcptool.protocol.dcp.constants import status_name
        from dcptool.protocol.errors import ErrorCode, RemoteError
        status = next(iter(events.failed.values()))
        raise RemoteError(ErrorCode.STATUS, f"every stream request failed, e.g. vbucket "
                          f"{next(iter(events.failed))}: {status_name(status)}", status)
