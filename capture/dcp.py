"""Capturing a DCP source (couchbase://, couchbases://) into a directory: the consumer
(protocol/dcp/client/) over the asyncio transport (protocol/transport/dcp_cluster.py), with a
tap that turns every receive batch into one Arrow record batch (protocol/dcp/wire/columnar.py
-> replay/store/dcp_batch.py) for the background Parquet writer. Frames we send are recorded
too (SASL payloads masked by the writer). When the writer's queue is long the consumer stops
acknowledging buffers, so the producer's flow control slows it and nothing is lost.

`capture_dcp(opts, settings)` is the call; `stream` uses the session pieces (make_session,
run_session, DcpEvents) with its own tap.
"""

from __future__ import annotations

import contextlib
import os
import time

import numpy as np

from dcptool.capture.dcp_resume import keep_filter, resume_from
from dcptool.capture.lag import DcpWatch
from dcptool.capture.options import CaptureSettings, LiveOptions
from dcptool.capture.process import fewer_gc_passes, without_pandas
from dcptool.capture.result import CaptureResult
from dcptool.capture.ring import compact_finished, retention, start_ring, stop_ring
from dcptool.capture.run import (
    END,
    MAX_MESSAGES,
    TO,
    NoProgress,
    RunStats,
    StopSignals,
    check_vbuckets,
    run_until_stopped,
    unserved_error,
    unserved_fields,
)
from dcptool.capture.shard import parse_shard, shard_name, shard_vbuckets
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.client import routing
from dcptool.protocol.dcp.client.consumer_api import FilterResolved, FilterUnknown
from dcptool.protocol.dcp.wire import columnar
from dcptool.protocol.dcp.wire.constants import status_name
from dcptool.protocol.errors import ErrorCode, LateUsageError, RemoteError

# Knobs tests turn down.
DEFAULTS = {"reconnects": 5, "pause_backlog_bytes": 32 * 2**20}   # the connect bound is --timeout


def consumer_config(opts: LiveOptions) -> dcp_consumer.ConsumerConfig:
    src = opts.source
    return dcp_consumer.ConsumerConfig(
        bucket=src.bucket, name=shard_name(opts.name or f"dcptool-{src.host}-{os.getpid()}", opts.shard),
        user=opts.user,
        password=opts.password, vbuckets=shard_vbuckets(opts), start=opts.from_, to=opts.to,
        no_value=opts.no_value, xattrs=opts.xattrs, collections=opts.collections,
        buffer_size=opts.buffer_size, noop_interval=opts.noop_interval, timeout=opts.timeout, tls=src.tls,
        allow_plain=opts.sasl_plain, check_vbuckets=opts.vbuckets is not None,
        compress=opts.compress, sync_writes=opts.sync_writes, expiry_opcode=opts.expiry_opcode,
        ack_ratio=opts.ack_ratio, required=frozenset(opts.required_controls), change_streams=opts.change_streams,
        oso=opts.oso,
        scopes=tuple(opts.scopes), collection_names=tuple(opts.collection_names),
        stream_filter=opts.stream_filter, stream_ids=opts.stream_ids, stream_groups=tuple(opts.stream_groups),
        stream_filters=None if opts.stream_filters is None else tuple(opts.stream_filters),
        shard=parse_shard(opts.shard))


def tls_for(opts: LiveOptions):
    if not opts.source.tls:
        return None
    from dcptool.protocol.transport.dcp_client import tls_context
    return tls_context(opts.ca_cert, opts.insecure)


def make_session(opts: LiveOptions, **kw):
    """The session of a DCP run: the seeds of the source, a cluster map followed when the
    server has one (protocol/transport/dcp_cluster.py), else one node."""
    from dcptool.protocol.transport.dcp_cluster import ClusterSession
    return ClusterSession(consumer_config(opts), opts.source.seed_list, tls=tls_for(opts),
                          connect_timeout=opts.timeout, conn_per_node=opts.conn_per_node,
                          config_poll=opts.config_poll, **kw)


def run_session(session, duration: float | None, stats: RunStats | None = None,
                signals: StopSignals | None = None, on_attach=None, before_stop=None):
    """Run a transport Session on a fresh event loop until it ends, `duration` passes, or a
    signal (SIGINT, SIGTERM, SIGHUP through `signals`) asks it to close its streams. Returns
    the consumer (None when a signal came before it started); the reason is in `stats`.
    `before_stop()` runs first when a stop is asked (the last lag poll, capture/lag.py)."""
    stats = stats if stats is not None else RunStats("dcp", "")

    def request_stop(reason: str) -> None:
        stats.stop(reason)
        if before_stop is not None and not session.stopped:
            before_stop()
        session.stop()

    return run_until_stopped(session.run, request_stop, stats, duration=duration, signals=signals,
                             when_cancelled=lambda: session.consumer, on_attach=on_attach)


class DcpEvents:
    """The consumer's events as the state of a run: streams failed and ended, rollbacks,
    vbuckets a cluster could not serve, the nodes of the map. A --vbuckets beyond the
    bucket's or a filter naming unknown collections raises LateUsageError. `tell(event,
    self)` is called after each event is counted (the CLI prints a line for some);
    `on_map(nodes)` with the node list of each newer cluster map."""

    def __init__(self, requested: list[int] | None = None, tell=None, on_map=None):
        self.requested = requested     # --vbuckets, checked against the server's vbuckets
        self.tell = tell
        self.on_map = on_map
        self.unserved: dict[int, str] = {}
        self.nodes: tuple = ()
        self.new_nodes = False         # the last map's nodes differ from the one before
        self.failed: dict[int, int] = {}
        self.rollbacks = 0
        self.ends: dict[int, int] = {}
        self.streaming = False         # a handshake completed: the run reached its streams

    def __call__(self, events) -> None:
        for e in events:
            self.count(e)
            if self.tell is not None:
                self.tell(e, self)

    def count(self, e) -> None:
        t = type(e)
        if t is dcp_consumer.ServerVbuckets:
            check_vbuckets(self.requested, e.vbuckets)
        elif t is dcp_consumer.HandshakeComplete:
            self.streaming = True
        elif t is dcp_consumer.Rollback:
            self.rollbacks += 1
        elif t is dcp_consumer.StreamFailed:
            self.failed[e.vbucket] = e.status
        elif t is routing.MapApplied:
            self.new_nodes = e.nodes != self.nodes
            self.nodes = e.nodes
            if self.on_map is not None:
                self.on_map(e.nodes)
        elif t is FilterUnknown:
            raise LateUsageError(e.message)
        elif t is routing.Unserved:
            self.unserved[e.vbucket] = e.reason
        elif t is dcp_consumer.StreamEnded:
            self.ends[e.vbucket] = e.reason


def finish_reason(opts: LiveOptions, events: DcpEvents) -> str:
    """Why a DCP run that nobody stopped ended: every stream reached --to, or the server
    ended them."""
    if opts.to != "forever" and not events.failed and all(r == 0 for r in events.ends.values()):
        return TO
    return END


def every_stream_failed(events: DcpEvents) -> RemoteError:
    status = next(iter(events.failed.values()))
    return RemoteError(ErrorCode.STATUS, f"every stream request failed, e.g. vbucket "
                       f"{next(iter(events.failed))}: {status_name(status)}", status)


class CaptureTap:
    """Receives every frame from the transport and hands Arrow batches to the writer."""

    def __init__(self, bg, progress, *, max_messages: int | None = None, on_limit=None, watch=None):
        from dcptool.replay.store.dcp_batch import to_record_batch
        self._to_batch = to_record_batch
        self.bg = bg
        self.progress = progress
        self.frame_no = 0
        self.conn = 0
        self.node: str | None = None
        self.consumer: dcp_consumer.Consumer | None = None
        self.opaque_vb: dict[int, int] = {}     # this connection's: request opaque -> vbucket
        self._opaque_vbs: dict[int, dict[int, int]] = {}   # per connection (opaques repeat across them)
        self.received = 0
        self.wire_bytes = 0
        self.sent = 0
        self.sent_bytes = 0
        self.connections = 0            # connections made (something was sent on them)
        self.remaining = max_messages
        self.on_limit = on_limit
        self._held: list | None = []    # batches held until the options metadata is final
        self._out: list = []            # sent frames not yet in a batch: (frame_no, frame, ts, mono)
        self._next_progress = 0.0
        self.watch = watch              # --metrics / --lag-interval (capture/lag.py), or None

    # -- transport hooks
    def attach(self, conn: int, consumer: dcp_consumer.Consumer, node: str | None = None) -> None:
        if conn == self.conn and consumer is self.consumer and node == self.node:
            return
        self._flush_out()
        self.conn, self.consumer, self.node = conn, consumer, node
        self.opaque_vb = self._opaque_vbs.setdefault(conn, {})

    def on_sent(self, frame: bytes, ts_ns: int, mono_ns: int) -> None:
        self.sent += 1
        self.sent_bytes += len(frame)
        self.connections = max(self.connections, self.conn)
        self._out.append((self.frame_no, frame, ts_ns, mono_ns))
        self.frame_no += 1

    def on_received(self, buf, offsets, lengths, ts_ns: int, mono_ns: int) -> None:
        self._flush_out()
        n = len(offsets)
        if n == 0:
            return
        collections = self.consumer.handshake.collections if self.consumer is not None else False
        batch = columnar.decode_batch(buf, offsets, lengths, collections=collections,
                                      opaque_vbuckets=self.opaque_vb)
        rb = self._to_batch(batch, frame_no=np.arange(self.frame_no, self.frame_no + n, dtype=np.int64),
                            conn=self.conn, ts_ns=np.full(n, ts_ns, dtype=np.int64),
                            mono_ns=np.full(n, mono_ns, dtype=np.int64), direction=np.zeros(n, dtype=np.uint8),
                            node=self.node)
        self.frame_no += n
        self.received += n
        nbytes = int(lengths.sum())
        self.wire_bytes += nbytes
        self._submit(rb)
        if self.watch is not None:
            self.watch.received(buf, offsets, lengths, self.conn, self.node, self.consumer)
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
    @property
    def holding(self) -> bool:
        """Batches are held until the options metadata is final (the handshake's features)."""
        return self._held is not None

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
        collections = self.consumer.handshake.collections if self.consumer is not None else False
        batch = columnar.decode_batch(buf, offsets, lengths, collections=collections, opaque_vbuckets=self.opaque_vb)
        rb = self._to_batch(batch, frame_no=np.array([x[0] for x in out], dtype=np.int64), conn=self.conn,
                            ts_ns=np.array([x[2] for x in out], dtype=np.int64),
                            mono_ns=np.array([x[3] for x in out], dtype=np.int64),
                            direction=np.ones(len(out), dtype=np.uint8), node=self.node)
        self._submit(rb)

    def finish(self) -> None:
        self._flush_out()
        self.release()

    def _progress_details(self) -> None:
        c = self.consumer
        if c is None:
            return
        ended = sum(1 for s in c.streams.states.values() if s.ended_reason is not None)
        self.progress.update(streams_open=max(0, len(c.streams.states) - ended), streams_ended=ended,
                             positions={vb: s.last_seqno for vb, s in c.streams.vb_states().items()},
                             bytes_written=self.bg.writer.bytes_written, backlog_bytes=self.bg.backlog_bytes)


class DcpCapture:
    """One capture of a DCP source into settings.output, in named steps: prepare (resume
    state, options), open (writer, tap, session), stream, close (the writer), result."""

    def __init__(self, opts: LiveOptions, settings: CaptureSettings, *, progress=None, tell=None, note=None):
        self.opts, self.settings = opts, settings
        self.make_progress = progress or NoProgress
        self.tell = tell
        self.note = note or (lambda text: None)
        self.session = self.loop = self.writer = self.bg = self.tap = self.ring = None
        self.pause_at = DEFAULTS["pause_backlog_bytes"]
        self.watch = DcpWatch(opts.metrics, opts.lag_interval)

    def run(self, signals: StopSignals) -> CaptureResult:
        self._prepare()
        self._open()
        error, consumer = self._stream(signals)
        files, error = self._close(error)
        return self._result(files, error, consumer, signals)

    def _prepare(self) -> None:
        opts, out = self.opts, self.settings.output
        self.resume, self.recovered = resume_from(out, opts.shard) if self.settings.resume else ({}, [])
        if self.settings.resume:     # after resume_from: the segments a killed run left are finished
            keep_filter(opts, out)
            self.note(f"resuming {len(self.resume)} vbuckets from the captures in {out}"
                      + (f" (finished {len(self.recovered)} in-progress segment(s))" if self.recovered else ""))
        self.options = opts.safe_dict()
        self.options["resumed_vbuckets"] = len(self.resume)
        self.progress = self.make_progress()
        self.events = DcpEvents(requested=opts.vbuckets, tell=self.tell)
        self.stats = RunStats("dcp", opts.source.url)

    def _open(self) -> None:
        from dcptool.replay.store.background import BackgroundWriter
        from dcptool.replay.store.writer import CaptureWriter, WriterError
        s = self.settings
        try:
            self.watch.start(say=self.note)   # before anything is written: a --metrics address in use is exit 2
        except BaseException:
            self.progress.close()
            raise
        try:
            self.writer = CaptureWriter(s.output, "dcp", source=self.opts.source.url, options=self.options,
                                        compression=s.compression, rotate_size=s.rotate_size,
                                        rotate_interval=s.rotate_interval)
        except WriterError:
            self.progress.close()
            self.watch.close()
            raise
        self.bg = BackgroundWriter(self.writer, on_error=self._writer_failed)
        self.ring = start_ring(s.output, "dcp", self.opts.source.url, retention(s), shard=self.opts.shard)
        if self.watch.live is not None:
            live, writer, bg = self.watch.live, self.writer, self.bg
            live.segments, live.queue_depth = (lambda: len(writer.segments)), (lambda: bg.queue_depth)
            live.unserved = lambda: len(self.events.unserved)
        fewer_gc_passes()
        self.tap = CaptureTap(self.bg, self.progress, max_messages=self.opts.max_messages, on_limit=self._on_limit,
                              watch=self.watch if self.watch.live is not None else None)
        self.session = make_session(self.opts, tap=self.tap, on_events=self._on_events, on_connect=self._on_connect,
                                    resume=self.resume or None, should_pause=self._should_pause,
                                    reconnects=DEFAULTS["reconnects"])

    # -- the session's callbacks
    def _stop(self) -> None:
        if self.session is not None:
            self.session.stop()

    def _on_connect(self, conn, consumer) -> None:
        import asyncio
        self.loop = asyncio.get_running_loop()
        self.watch.connected(conn, consumer)

    def _writer_failed(self, _exc) -> None:
        # the writer thread died (disk full ...): the consumer may be paused on the backlog,
        # with nothing arriving that would make it look, so end the session from here
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):   # the loop ended meanwhile
                loop.call_soon_threadsafe(self._stop)

    def _should_pause(self) -> bool:
        if self.bg.error is not None:
            self._stop()
            return True
        return self.bg.backlog_bytes > self.pause_at

    def _on_limit(self) -> None:
        self.stats.stop(MAX_MESSAGES)
        if self.session is not None and not self.session.stopped:
            self.watch.final()
        self._stop()

    def _on_events(self, evs) -> None:
        self.events(evs)
        options, tap = self.options, self.tap
        self.watch.events(evs, tap.consumer, tap.conn, self.events)
        for e in evs:
            if type(e) is FilterResolved:     # recorded with the options (resume keeps it)
                options["collection_filter"] = dict(e.filter)
                if e.filters:   # --stream-ids: the filter of each stream id, 1, 2, ...
                    options["stream_filters"] = [dict(f) if f else None for f in e.filters]
            if type(e) is dcp_consumer.HandshakeComplete and tap.holding:
                full = dict(options, hello_features=[f"0x{f:02x}" for f in e.features], dcp_controls=e.controls)
                self.writer.set_options(full)
                tap.release()
        if self.bg.error is not None:
            self._stop()

    # -- the run and its end
    def _stream(self, signals: StopSignals):
        from dcptool.replay.store.writer import WriterError
        error: BaseException | None = None
        consumer = None
        try:
            consumer = run_session(self.session, self.opts.duration, self.stats, signals,
                                   before_stop=self.watch.final)
        except BaseException as exc:  # noqa: BLE001 - the files are closed first, then it is re-raised
            error = exc
        finally:
            self.progress.close()
            self.watch.close()
            try:
                self.tap.finish()
            except WriterError:
                pass     # the writer's own error is raised by close below
        return error, consumer

    def _close(self, error: BaseException | None):
        from dcptool.replay.store.writer import WriterError
        try:
            files = self.bg.close()
        except WriterError as exc:
            # the disk error is what to report (the session only stopped because of it);
            # what was finished before it is listed as usual
            error = exc.with_traceback(None)
            files = list(self.writer.segments)
        if self.bg.error is not None and error is None:
            error = self.bg.error
        files = stop_ring(self.ring, files, self.note)
        if not isinstance(error, WriterError):     # a full disk: no room to merge, nothing tried
            files = compact_finished(self.settings.output, self.opts.source.url, self.opts.shard, files, self.note)
        return files, error

    def _result(self, files, error, consumer, signals: StopSignals) -> CaptureResult:
        events, stats, tap = self.events, self.stats, self.tap
        if error is None and consumer is not None and not self.session.stopped:
            stats.stop(finish_reason(self.opts, events))
            if events.failed and not events.ends:
                error = every_stream_failed(events)
            elif events.unserved:
                error = unserved_error(events.unserved)
        stop_exc = error if error is not None else signals.interrupted()
        stats.messages_in, stats.bytes_in = tap.received, tap.wire_bytes
        stats.messages_out, stats.bytes_out, stats.connections = tap.sent, tap.sent_bytes, tap.connections
        fields = {"capture_id": self.writer.capture_id, "frames": tap.frame_no, "received": tap.received,
                  "rollbacks": events.rollbacks, "streams_ended": len(events.ends),
                  **unserved_fields(events.unserved), **self.watch.summary_fields()}
        if self.recovered:
            fields["recovered_segments"] = self.recovered
        if self.ring is not None:
            fields["retained_away"] = len(self.ring.deleted)
        return CaptureResult(files=files, stats=stats, fields=fields, error=stop_exc,
                             wrote=bool(files) or error is None)


def capture_dcp(opts: LiveOptions, settings: CaptureSettings, *, progress=None, tell=None, note=None,
                signals: StopSignals | None = None) -> CaptureResult:
    """Capture the DCP source of `opts` into settings.output until the run ends (--to, a
    duration, max messages, a signal through `signals`, an error). Errors that end the
    stream come back in the result (its files are finished first); errors before it
    (a bad --resume, an unwritable directory) are raised. `progress()` makes the progress
    display (update/add/close), `tell(event, events)` hears every consumer event, `note(text)`
    gets the lines worth telling before the run (what --resume found)."""
    without_pandas()
    run = DcpCapture(opts, settings, progress=progress, tell=tell, note=note)
    if signals is not None:
        return run.run(signals)
    with StopSignals() as own:
        return run.run(own)
