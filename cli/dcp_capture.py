"""`dcptool capture couchbase://...`: the DCP consumer over the asyncio transport, with a
tap that turns every receive batch into one Arrow record batch (protocol/dcp/wire/columnar.py
-> replay/store/dcp_batch.py) for the background Parquet writer. Frames we send are recorded
too (SASL payloads masked by the writer). When the writer's queue is long the consumer
stops acknowledging buffers, so the producer's flow control slows it and nothing is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np

from dcptool.cli.console import err_console
from dcptool.cli.live import CaptureSettings, LiveOptions
from dcptool.cli.process import fewer_gc_passes, without_pandas
from dcptool.cli.view.run_summary import MAX_MESSAGES, RunStats, StopSignals
from dcptool.protocol.dcp.wire import columnar
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.wire.constants import StreamEndReason
from dcptool.protocol.dcp.client.consumer_api import FilterResolved

# Knobs tests turn down.
DEFAULTS = {"reconnects": 5, "pause_backlog_bytes": 32 * 2**20}   # the connect bound is --timeout


class CaptureTap:
    """Receives every frame from the transport and hands Arrow batches to the writer."""

    def __init__(self, bg, progress, *, max_messages: int | None = None, on_limit=None):
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
        collections = self.consumer.collections if self.consumer is not None else False
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
                            direction=np.ones(len(out), dtype=np.uint8), node=self.node)
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
                             positions={vb: s.last_seqno for vb, s in c.vb_states().items()},
                             bytes_written=self.bg.writer.bytes_written, backlog_bytes=self.bg.backlog_bytes)


def keep_filter(opts: LiveOptions, directory: str) -> None:
    """capture --resume keeps the collection filter (ids and manifest uid) the capture in
    `directory` recorded; other --scope / --collection names than it had are a usage error."""
    import os

    from dcptool.cli.errors import LateUsageError
    from dcptool.replay.store.resume import dcp_resume_options
    rec = dcp_resume_options(directory) if os.path.isdir(directory) else {}
    if rec and bool(rec.get("stream_ids")) != bool(opts.stream_ids) and (opts.stream_ids or _named(opts)):
        raise LateUsageError(f"--resume keeps the streams of the capture in {directory} (with"
                             f"{'' if rec.get('stream_ids') else 'out'} --stream-ids); give the same options or none")
    if rec.get("stream_ids"):
        _keep_stream_groups(opts, rec, directory)
        return
    flt = rec.get("collection_filter")
    given = (tuple(opts.scopes), tuple(opts.collection_names))
    recorded = (tuple(rec.get("scopes") or ()), tuple(rec.get("collection_names") or ()))
    if not rec or given == recorded and flt is None:
        return
    if flt is None or (any(given) and given != recorded):
        had = " ".join([*(f"--scope {x}" for x in recorded[0]), *(f"--collection {x}" for x in recorded[1])])
        raise LateUsageError(f"--resume keeps the collection filter of the capture in {directory} "
                             f"({had or 'none: every collection'}); give the same options or none")
    opts.scopes, opts.collection_names = recorded
    opts.stream_filter = dict(flt)
    opts.collections = True


def _named(opts: LiveOptions) -> bool:
    return bool(opts.scopes or opts.collection_names)


def _keep_stream_groups(opts: LiveOptions, rec: dict, directory: str) -> None:
    """capture --resume of a capture made with --stream-ids: the same stream ids, groups and
    resolved filters (each stream continues from its own recorded position)."""
    from dcptool.cli.errors import LateUsageError
    groups = tuple((tuple(sc), tuple(co)) for sc, co in rec.get("stream_groups") or ())
    if _named(opts) and tuple(opts.stream_groups) != groups:
        raise LateUsageError(f"--resume keeps the stream ids of the capture in {directory} "
                             f"({_describe_groups(groups)}); give the same options or none")
    opts.stream_ids, opts.collections, opts.stream_groups = True, True, groups
    opts.scopes = tuple(rec.get("scopes") or ())
    opts.collection_names = tuple(rec.get("collection_names") or ())
    if rec.get("stream_filters") is not None:
        opts.stream_filters = [dict(f) if f else None for f in rec["stream_filters"]]
    if rec.get("collection_filter") is not None:
        opts.stream_filter = dict(rec["collection_filter"])


def _describe_groups(groups: tuple) -> str:
    parts = [" ".join([*(f"--scope {x}" for x in sc), *(f"--collection {x}" for x in ([",".join(co)] if co else []))])
             for sc, co in groups]
    return "--stream-ids " + " ".join(parts) if parts else "--stream-ids"


def resume_from(directory: str) -> tuple[dict[int, dcp_consumer.VbState], list[str]]:
    """Per-vbucket state recorded by earlier captures in directory (finishing any segment a
    killed capture left in progress first)."""
    import os

    from dcptool.replay.store.reader import find_captures
    from dcptool.replay.store.resume import dcp_resume_state, recover_in_progress
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
        state[vb] = _vb_state(r)
    return state, recovered


def _vb_state(r) -> dcp_consumer.VbState:
    """A recorded VbResume as the consumer's VbState (with its streams' for stream ids). A
    stream that reached its end continues from there: the new run's end is later."""
    return dcp_consumer.VbState(failover_log=list(r.failover_log), last_seqno=r.last_seqno,
                                snap_start=r.snap_start, snap_end=r.snap_end, snapshot_complete=r.snapshot_complete,
                                # "filter empty": every filtered collection was dropped; not reopened
                                ended_reason=r.stream_end_reason if r.stream_end_reason == StreamEndReason.FILTER_EMPTY
                                else None,
                                streams={sid: _vb_state(x) for sid, x in r.streams.items()})


def run_capture(opts: LiveOptions, settings: CaptureSettings) -> None:
    without_pandas()
    from dcptool.cli.dcp_live import EventLog, every_stream_failed, finish_reason, make_session, run_session
    from dcptool.cli.view.progress import make_progress, print_summary
    from dcptool.cli.view.run_summary import unserved_error, unserved_fields
    from dcptool.replay.store.background import BackgroundWriter
    from dcptool.replay.store.writer import CaptureWriter, WriterError

    out = settings.output
    resume, recovered = resume_from(out) if settings.resume else ({}, [])
    if settings.resume:     # after resume_from: the segments a killed run left are finished
        keep_filter(opts, out)
    if settings.resume:
        err_console().print(f"resuming {len(resume)} vbuckets from the captures in {out}"
                            + (f" (finished {len(recovered)} in-progress segment(s))" if recovered else ""),
                            highlight=False)
    options = opts.safe_dict()
    options["resumed_vbuckets"] = len(resume)
    progress = make_progress("dcp", quiet=settings.quiet)
    events = EventLog(quiet=settings.quiet, requested=opts.vbuckets)
    stats = RunStats("dcp", opts.source.url)
    box: dict = {}

    def stop():
        s = box.get("session")
        if s is not None:
            s.stop()

    def on_connect(conn, consumer):
        box["loop"] = asyncio.get_running_loop()

    def writer_failed(_exc):
        # the writer thread died (disk full ...): the consumer may be paused on the backlog,
        # with nothing arriving that would make it look, so end the session from here
        loop = box.get("loop")
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):   # the loop ended meanwhile
                loop.call_soon_threadsafe(stop)

    def should_pause():
        if bg.error is not None:
            stop()
            return True
        return bg.backlog_bytes > pause_at

    writer = bg = tap = None
    handshake: dict = {}

    def on_events(evs):
        events(evs)
        for e in evs:
            if type(e) is FilterResolved:     # recorded with the options (resume keeps it)
                options["collection_filter"] = dict(e.filter)
                if e.filters:   # --stream-ids: the filter of each stream id, 1, 2, ...
                    options["stream_filters"] = [dict(f) if f else None for f in e.filters]
            if type(e) is dcp_consumer.HandshakeComplete and tap._held is not None:
                handshake.update(features=list(e.features), controls=dict(e.controls))
                full = dict(options, hello_features=[f"0x{f:02x}" for f in e.features], dcp_controls=e.controls)
                writer.set_options(full)
                tap.release()
        if bg.error is not None:
            stop()

    try:
        writer = CaptureWriter(out, "dcp", source=opts.source.url, options=options,
                               compression=settings.compression,
                               rotate_size=settings.rotate_size,
                               rotate_interval=settings.rotate_interval)
    except WriterError:
        progress.close()
        raise
    bg = BackgroundWriter(writer, on_error=writer_failed)
    fewer_gc_passes()
    def on_limit():
        stats.stop(MAX_MESSAGES)
        stop()

    tap = CaptureTap(bg, progress, max_messages=opts.max_messages, on_limit=on_limit)
    pause_at = DEFAULTS["pause_backlog_bytes"]
    session = make_session(opts, tap=tap, on_events=on_events, on_connect=on_connect, resume=resume or None,
                           should_pause=should_pause, reconnects=DEFAULTS["reconnects"])
    box["session"] = session
    error: BaseException | None = None
    consumer = None
    # SIGINT (even when inherited ignored), SIGTERM, SIGHUP: the same clean finish as Ctrl-C
    signals = StopSignals().__enter__()
    try:
        consumer = run_session(session, opts.duration, stats, signals)
    except BaseException as exc:  # noqa: BLE001 - the files are closed first, then it is re-raised
        error = exc
    finally:
        progress.close()
        try:
            tap.finish()
        except WriterError:
            pass     # the writer's own error is raised by close below
    try:
        files = bg.close()
    except WriterError as exc:
        # the disk error is what to report (the session only stopped because of it);
        # what was finished before it is listed as usual
        error = exc.with_traceback(None)
        files = list(writer.segments)
    if bg.error is not None and error is None:
        error = bg.error
    if error is None and consumer is not None and not session.stopped:
        stats.stop(finish_reason(opts, events))
        if events.failed and not events.ends:
            error = every_stream_failed(events)
        elif events.unserved:
            error = unserved_error(events.unserved)
    stop_exc = error if error is not None else signals.interrupted()
    stats.messages_in, stats.bytes_in = tap.received, tap.wire_bytes
    stats.messages_out, stats.bytes_out, stats.connections = tap.sent, tap.sent_bytes, tap.connections
    extra = {**stats.summary(stop_exc), "capture_id": writer.capture_id, "frames": tap.frame_no,
             "received": tap.received, "rollbacks": events.rollbacks, "streams_ended": len(events.ends),
             **unserved_fields(events.unserved)}
    if recovered:
        extra["recovered_segments"] = recovered
    if files or error is None:
        print_summary(files, json_summary=settings.json_summary,
                      quiet=settings.quiet, extra=extra)
    signals.__exit__(None, None, None)
    if stop_exc is not None:
        raise stop_exc
