"""Capturing a DCP source (couchbase://, couchbases://) into a directory: the DCP session of
capture/dcp_session.py (the consumer over the asyncio transport) with capture/dcp_tap.py's
CaptureTap, which turns every receive batch into one Arrow record batch for the background
Parquet writer. Frames we send are recorded too (SASL payloads masked by the writer). When
the writer's queue is long the consumer stops acknowledging buffers, so the producer's flow
control slows it and nothing is lost.

`capture_dcp(opts, settings)` is the call; `stream` runs the same session and tap
(live/dcp_rows.py) without the writer.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from dcptool.capture.dcp_resume import keep_filter, resume_from
from dcptool.capture.dcp_session import (
    DcpEvents,
    every_stream_failed,
    finish_reason,
    make_session,
    run_session,
)
from dcptool.capture.dcp_tap import CaptureTap
from dcptool.capture.lag import DcpWatch
from dcptool.capture.options import CaptureSettings, LiveOptions
from dcptool.capture.process import fewer_gc_passes, without_pandas
from dcptool.capture.result import CaptureResult
from dcptool.capture.ring import (
    Ring,
    compact_finished,
    retention,
    start_ring,
    stop_ring,
)
from dcptool.capture.run import (
    MAX_MESSAGES,
    NoProgress,
    RunStats,
    StopSignals,
    unserved_error,
    unserved_fields,
)
from dcptool.protocol.dcp.client import consumer as dcp_consumer
from dcptool.protocol.dcp.client.consumer_api import FilterResolved
from dcptool.replay.store.background import BackgroundWriter
from dcptool.replay.store.resume import SourceMismatch, bucket_identity, check_identity
from dcptool.replay.store.writer import CaptureWriter, WriterError

if TYPE_CHECKING:
    from dcptool.protocol.transport.dcp_cluster import ClusterSession

# Knobs tests turn down (the session's own, the reconnect count, are capture/dcp_session.py's).
DEFAULTS = {"pause_backlog_bytes": 32 * 2**20}


class DcpCapture:
    """One capture of a DCP source into settings.output, in named steps: prepare (resume
    state, options), open (writer, tap, session), stream, close (the writer), result."""

    writer: CaptureWriter     # these three: made by _open, before anything uses them
    bg: BackgroundWriter
    tap: CaptureTap

    def __init__(self, opts: LiveOptions, settings: CaptureSettings, *, progress=None, tell=None, note=None):
        self.opts, self.settings = opts, settings
        self.make_progress = progress or NoProgress
        self.tell = tell
        self.note = note or (lambda text: None)
        self.session: ClusterSession | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ring: Ring | None = None
        self.source_id: str | None = None     # the source's identity, once its connection is set up
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
                              watch=self.watch if self.watch.live is not None else None, stats=self.stats)
        self.session = make_session(self.opts, tap=self.tap, on_events=self._on_events, on_connect=self._on_connect,
                                    resume=self.resume or None, should_pause=self._should_pause)

    # -- the session's callbacks
    def _stop(self) -> None:
        if self.session is not None:
            self.session.stop()

    def _on_connect(self, conn, consumer) -> None:
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
                source_id = self._identity(e.bucket_uuid)
                full = dict(options, hello_features=[f"0x{f:02x}" for f in e.features], dcp_controls=e.controls)
                self.writer.set_options(full, source_id)
                if self.ring is not None:
                    self.ring.identify(source_id)
                tap.release()
            elif type(e) is dcp_consumer.HandshakeComplete and e.bucket_uuid and self.source_id \
                    and bucket_identity(e.bucket_uuid) != self.source_id:     # a node of another bucket
                raise SourceMismatch(f"{self.settings.output}: the capture of bucket uuid "
                                     f"{self.source_id.partition(':')[2]} reached another bucket, uuid "
                                     f"{e.bucket_uuid}, on a new connection; stopped")
        if self.bg.error is not None:
            self._stop()

    def _identity(self, bucket_uuid: str) -> str:
        """The source's identity (its bucket's UUID), checked against the captures already in
        the directory before anything of this run is written: another bucket there ends the
        run with SourceMismatch (exit 2) and every frame held so far is dropped."""
        source_id = bucket_identity(bucket_uuid)
        s = self.settings
        try:
            check_identity(s.output, "dcp", self.opts.source.url, source_id, resume=s.resume, force_new=s.force_new)
        except SourceMismatch:
            self.tap.discard()
            raise
        self.source_id = source_id
        return source_id

    # -- the run and its end
    def _stream(self, signals: StopSignals):
        error: BaseException | None = None
        consumer = None
        try:
            assert self.session is not None, "_open made it"
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
            files = compact_finished(self.settings.output, self.opts.source.url, self.opts.shard, files, self.note,
                                     self.source_id)
        return files, error

    def _result(self, files, error, consumer, signals: StopSignals) -> CaptureResult:
        events, stats, tap, session = self.events, self.stats, self.tap, self.session
        assert session is not None, "_open made it"
        if error is None and consumer is not None and not session.stopped:
            stats.stop(finish_reason(self.opts, events))
            if events.failed and not events.ends:
                error = every_stream_failed(events)
            elif events.unserved:
                error = unserved_error(events.unserved)
        stop_exc = error if error is not None else signals.interrupted()
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
