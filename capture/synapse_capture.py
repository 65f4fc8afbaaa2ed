"""Capturing a Synapse source (synapse://, synapse+redis://) into a directory: the client
(protocol/synapse/client.py) over the transports (protocol/transport/synapse_tcp_redis.py), each block
of lines one Arrow batch (replay/store/synapse_batch.py) for the background Parquet writer.

`capture_synapse(opts, settings)` is the call; `stream` uses make_client, SynapseRun and run
with its own handler.
"""

from __future__ import annotations

import os
import time

from dcptool.capture.metrics import LiveMetrics, start, wire_synapse
from dcptool.capture.options import CaptureSettings, LiveOptions, default_name
from dcptool.capture.result import CaptureResult
from dcptool.capture.ring import (
    Ring,
    compact_finished,
    retention,
    start_ring,
    stop_ring,
)
from dcptool.capture.run import (
    DURATION,
    MAX_MESSAGES,
    RunStats,
    StopSignals,
    run_until_stopped,
)
from dcptool.capture.synapse_catchup import CHANNEL, CatchUp
from dcptool.protocol.synapse.client import Gap, ServerError, SynapseClient
from dcptool.protocol.transport import synapse_tcp_redis as synapse_transport
from dcptool.replay.store import retained
from dcptool.replay.store.background import BackgroundWriter
from dcptool.replay.store.resume import (
    SourceMismatch,
    check_identity,
    display_identity,
    recover_in_progress,
    server_identity,
    synapse_resume_state,
)
from dcptool.replay.store.synapse_batch import build_batch, build_batch_scan
from dcptool.replay.store.writer import CaptureWriter, WriterError

# Knobs the tests turn down (keep-alive and reconnects); the protocol's own values otherwise.
DEFAULTS = {"ping_interval": 5.0, "timeout": 25.0, "max_reconnects": 5,
            "backoff_base": 0.2, "backoff_cap": 10.0, "connect_timeout": 10.0}


def make_client(opts: LiveOptions, committed=None, catch_up: bool = False) -> SynapseClient:
    src = opts.source
    tcp = src.scheme == "synapse"
    name = opts.name or default_name(src)
    return SynapseClient(name, expected_server=src.server_name if tcp else None,
                         replicate=opts.replicate, keepalive=tcp,
                         ping_interval=DEFAULTS["ping_interval"], timeout=DEFAULTS["timeout"],
                         committed=committed, wait_for_position=catch_up)


async def transport(opts: LiveOptions, client: SynapseClient, handler) -> None:
    src = opts.source

    def backoff(n):
        return synapse_transport.backoff_delay(n, DEFAULTS["backoff_base"], DEFAULTS["backoff_cap"])

    max_reconnects, connect_timeout = int(DEFAULTS["max_reconnects"]), DEFAULTS["connect_timeout"]
    if src.scheme == "synapse":
        await synapse_transport.run_tcp(src.host, src.port, client, handler, max_reconnects=max_reconnects,
                                        backoff=backoff, connect_timeout=connect_timeout)
    else:
        assert src.server_name is not None, "parse_source refuses synapse+redis:// without one"
        await synapse_transport.run_redis(src.host, src.port, src.server_name, client, handler, db=src.db,
                          password=opts.password, username=opts.user, tls=src.tls,
                          ca_cert=opts.ca_cert, insecure=opts.insecure, max_reconnects=max_reconnects,
                          backoff=backoff, connect_timeout=connect_timeout)


class SynapseRun:
    """Stop conditions and the counts shared by stream and capture: the transport's handler.
    `tell(event)` hears every client event after it is counted (the CLI prints gaps and
    reconnects)."""

    def __init__(self, opts: LiveOptions, tell=None):
        self.opts = opts
        self.tell = tell
        self.received = 0
        self.deadline = time.monotonic() + opts.duration if opts.duration else None
        self.stop = False
        self.gaps: list[Gap] = []
        self.server_errors: list[str] = []
        self.streams = set(opts.streams) if opts.streams else None
        self.stats = RunStats("synapse", opts.source.url)
        self.client: SynapseClient | None = None
        self.metrics = None    # --metrics: a capture/metrics.py LiveMetrics

    def request_stop(self, reason: str) -> None:
        self.stats.stop(reason)
        self.stop = True

    def should_stop(self) -> bool:
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.request_stop(DURATION)
        return self.stop

    def count_in(self, n: int) -> None:
        self.received += n
        if self.opts.max_messages and self.received >= self.opts.max_messages:
            self.request_stop(MAX_MESSAGES)

    def count(self, direction: str, conn: int, n: int, nbytes: int) -> None:
        """This run's common counters (the summary): n lines of nbytes on the wire."""
        st = self.stats
        if direction == "in":
            st.messages_in += n
            st.bytes_in += nbytes
        else:
            st.messages_out += n
            st.bytes_out += nbytes
        if conn > st.connections:
            st.connections = conn

    @property
    def streaming(self) -> bool:
        """The run got as far as replication data (a POSITION or RDATA arrived)."""
        return self.client is not None and self.client.data_lines > 0

    def observe(self, direction: str, batch) -> None:
        """A batch of lines crossed the wire: --metrics counts the received ones per command."""
        if self.metrics is not None and direction == "in":
            self.metrics.count_record_batch(batch)

    def events(self, events: list) -> None:
        for ev in events:
            if self.metrics is not None:
                if isinstance(ev, Gap):
                    self.metrics.gaps += 1
                elif type(ev).__name__ == "Reconnecting":
                    self.metrics.reconnects += 1
            if isinstance(ev, Gap):
                self.gaps.append(ev)
            elif isinstance(ev, ServerError):
                self.server_errors.append(ev.text)
            if self.tell is not None:
                self.tell(ev)

    def paused(self) -> bool:
        return False

    def tick(self) -> None:
        pass


def run(opts: LiveOptions, client: SynapseClient, handler: SynapseRun, signals: StopSignals,
        on_attach=None, catch_up: CatchUp | None = None) -> None:
    """Run the transport until the handler stops it, an error ends it, or a signal (SIGINT,
    SIGTERM, SIGHUP through `signals`) or --duration asks it to stop; with `catch_up`, its
    fetches run beside it (and may finish queued ones after it, unless a signal came)."""
    def start():
        if catch_up is None:
            return transport(opts, client, handler)
        return catch_up.around(transport(opts, client, handler),
                               hurry=lambda: handler.stats.signum is not None)
    run_until_stopped(start, handler.request_stop, handler.stats,
                      duration=opts.duration, signals=signals, on_attach=on_attach)


def line_bytes(lines, channel) -> int:
    # on TCP each line ends with a newline on the wire; a Redis message is the line itself
    return sum(map(len, lines)) + (len(lines) if channel is None else 0)


def resume_state(directory: str, hold_gaps: bool = False) -> tuple[dict[tuple[str, str], int], list[str]]:
    """Committed tokens per (stream, instance) from the Synapse captures in ``directory``,
    after leftover in-progress segments are finished (replay/store/resume.py does both, for
    DCP too). Returns (tokens, paths of the segments finished)."""
    finished = recover_in_progress(directory)
    if not os.path.isdir(directory):
        return {}, finished
    # after the head a retention ring deleted (capture/ring.py), the tokens the rest commits
    dropped = retained.stream_tokens(retained.load(os.path.join(directory, retained.record_name(None))))
    return {**dropped, **synapse_resume_state([directory], hold_gaps)}, finished


class Identity:
    """The source's identity (its server name, CAPTURE_FORMAT.md "One source per directory"):
    from the URL where it names one (synapse+redis://, ?server_name=), else from the first
    SERVER line. Once known it is checked against the captures in the directory (another
    server there: SourceMismatch, exit 2) and recorded as `dcptool.source_id`; a later SERVER
    line naming another server (a reconnect reached another one) ends the run the same way."""

    def __init__(self, opts: LiveOptions, settings: CaptureSettings, writer: CaptureWriter, options: dict,
                 ring: Ring | None):
        self.url, self.settings, self.writer, self.options, self.ring = opts.source.url, settings, writer, options, ring
        self.source_id: str | None = None     # None: not known yet ("": the source gave none)
        if opts.source.server_name:
            self.seen(opts.source.server_name)

    def seen(self, server_name: str | None) -> None:
        """The server's name as the client last read it (None: no SERVER line, or not yet)."""
        sid = server_identity(server_name)
        if self.source_id is None:
            s = self.settings
            check_identity(s.output, "synapse", self.url, sid, resume=s.resume, force_new=s.force_new)
            self.writer.set_options(self.options, sid)
            if self.ring is not None:
                self.ring.identify(sid)
            self.source_id = sid
        elif sid and self.source_id and sid != self.source_id:
            raise SourceMismatch(f"{self.settings.output}: the capture of {display_identity(self.source_id, self.url)} "
                                 f"reached another server on reconnecting, {display_identity(sid, self.url)}; "
                                 "stopped before recording anything it sent")


class CaptureHandler(SynapseRun):
    """`capture`'s handler: every block of lines one Arrow batch for the writer. Until the
    source's identity is settled (the SERVER line of a synapse:// source that names no
    server_name) its batches are held, then checked against the directory (`identity`)."""

    def __init__(self, opts: LiveOptions, bg, progress, tell=None, identity: Identity | None = None):
        super().__init__(opts, tell)
        self.identity = identity
        self._held: list | None = [] if identity is not None and identity.source_id is None else None
        self.catch_up: CatchUp | None = None     # --catch-up: capture/synapse_catchup.py
        self.bg = bg
        self.frame_no = 0
        self.bytes = 0
        self.progress = progress
        self.client: SynapseClient | None = None
        src = opts.source  # the `node` column: the TCP or Redis server address
        self.node = f"[{src.host}]:{src.port}" if ":" in str(src.host) else f"{src.host}:{src.port}"

    def lines(self, direction, lines, split, *, conn, ts_ns, mono_ns, channel=None, errors=None):
        batch = build_batch(lines, frame_no=self.frame_no, conn=conn, ts_ns=ts_ns,
                            mono_ns=mono_ns, direction=direction, channel=channel, split=split,
                            errors=errors, node=self.node)
        self.frame_no += len(lines)
        self.bytes += sum(map(len, lines))
        self.count(direction, conn, len(lines), line_bytes(lines, channel))
        self.observe(direction, batch)
        self._submit(direction, batch)
        if direction == "in":
            self.count_in(len(lines))

    def block(self, direction, scan, *, conn, ts_ns, mono_ns, channel=None):
        batch = build_batch_scan(scan, frame_no=self.frame_no, conn=conn, ts_ns=ts_ns,
                                 mono_ns=mono_ns, direction=direction, channel=channel, node=self.node)
        self.frame_no += scan.n
        self.bytes += len(scan.buf)
        self.count(direction, conn, scan.n, len(scan.buf))
        self.observe(direction, batch)
        self._submit(direction, batch)
        if direction == "in":
            self.count_in(scan.n)

    def _submit(self, direction: str, batch) -> None:
        """To the writer, once the source's identity is settled: the first lines received
        settle it (the client has read them: a SERVER line named the server, or none came)."""
        ident = self.identity
        if ident is not None and direction == "in" and self.client is not None:
            ident.seen(self.client.server_name)      # raises SourceMismatch before anything is written
        if self._held is not None:
            self._held.append(batch)
            if ident is None or ident.source_id is None:
                return
            held, self._held = self._held, None
            for b in held:
                self.bg.submit(b)
            return
        self.bg.submit(batch)

    def events(self, events: list) -> None:
        super().events(events)
        if self.catch_up is not None:
            for ev in events:
                if isinstance(ev, Gap):
                    self.catch_up.gap(ev)

    def record_catch_up(self, direction: str, lines: list[str], node: str) -> None:
        """Lines of a catch-up (the request going out, the rows and range fetched), recorded
        beside the live lines with channel `catch-up` and the writer's address as node."""
        from dcptool.replay.store.synapse_batch import build_batch
        ts_ns, mono_ns = time.time_ns(), time.monotonic_ns()
        raw = [line.encode("utf-8") for line in lines]
        conn = self.client.connections if self.client is not None else 0
        batch = build_batch(raw, frame_no=self.frame_no, conn=conn, ts_ns=ts_ns, mono_ns=mono_ns,
                            direction=direction, channel=CHANNEL, node=node)
        self.frame_no += len(raw)
        self.bytes += sum(map(len, raw))
        self._submit(direction, batch)

    def finish(self) -> None:
        """The run ended before any line came in: what it sent is written (no identity)."""
        if self._held is not None and self.identity is not None:
            if self.identity.source_id is None:
                self.identity.seen(None)
            held, self._held = self._held, None
            for b in held:
                self.bg.submit(b)

    def paused(self) -> bool:
        if self.bg.error is not None:
            raise self.bg.error
        return self.bg.congested

    def tick(self) -> None:
        if self.bg.error is not None:
            raise self.bg.error
        if self.progress is not None:
            self.progress(self)


def capture_synapse(opts: LiveOptions, settings: CaptureSettings, *, progress=None, tell=None, note=None,
                    signals: StopSignals | None = None) -> CaptureResult:
    """Capture the Synapse source of `opts` into settings.output until the run ends (a
    duration, max messages, a signal through `signals`, an error). Errors that end the
    stream come back in the result (its files are finished first); errors before it are
    raised. `progress(handler)` is called on every tick, `tell(event)` hears every client
    event, `note(text)` gets the lines worth telling before the run (what --resume found)."""
    if signals is None:
        with StopSignals() as own:
            return capture_synapse(opts, settings, progress=progress, tell=tell, note=note, signals=own)
    live = LiveMetrics("synapse") if opts.metrics else None
    server = start(opts.metrics, live)    # before anything is written: an address in use is exit 2
    if server is not None and note is not None:
        note(f"metrics: {server.url}")
    try:
        committed, leftovers = _resume(settings, note)
        writer, bg, options = _open_writer(opts, settings, committed)
    except BaseException:
        if server is not None:
            server.close()
        raise
    ring = start_ring(settings.output, "synapse", opts.source.url, retention(settings))
    try:
        identity = Identity(opts, settings, writer, options, ring)   # from the URL: checked now
    except BaseException:
        stop_ring(ring, [], lambda text: None)
        bg.close()      # nothing was written: no file
        if server is not None:
            server.close()
        raise
    handler = CaptureHandler(opts, bg, progress, tell, identity)
    client = handler.client = make_client(opts, committed=committed, catch_up=bool(settings.catch_up))
    wire_synapse(live, handler, client, writer=writer, bg=bg)
    if settings.catch_up:
        handler.catch_up = CatchUp(dict(settings.catch_up), settings.catch_up_secret,
                                   handler.record_catch_up, note or (lambda text: None))
    error: BaseException | None = None
    try:
        run(opts, client, handler, signals, catch_up=handler.catch_up)
    except BaseException as exc:  # noqa: BLE001 - files are closed first, then re-raised
        error = exc
    finally:
        if server is not None:
            server.close()
    if not isinstance(error, SourceMismatch):
        try:
            handler.finish()
        except SourceMismatch as exc:
            error = error or exc
    try:
        segments = bg.close()
    except WriterError as exc:   # what was finished before the disk error is listed as usual
        error = error or exc.with_traceback(None)
        segments = list(writer.segments)
    segments = stop_ring(ring, segments, note or (lambda text: None))
    if not isinstance(error, WriterError):     # a full disk: no room to merge, nothing tried
        segments = compact_finished(settings.output, opts.source.url, None, segments, note or (lambda text: None),
                                    identity.source_id)
    fields = {
        "capture_id": writer.capture_id,
        "finished_leftovers": leftovers,
        "lines": handler.frame_no,
        "received": handler.received,
        "gaps": [{"stream": g.stream, "instance": g.instance, "committed": g.committed,
                  "prev_token": g.prev_token, "new_token": g.new_token, "kind": g.kind}
                 for g in handler.gaps],
        "committed": {f"{s}/{i}": t for (s, i), t in sorted(client.committed().items())},
        "server_errors": handler.server_errors,
        **({"retained_away": len(ring.deleted)} if ring is not None else {}),
        **(handler.catch_up.summary() if handler.catch_up is not None else {}),
    }
    filled = handler.catch_up.filled if handler.catch_up is not None else 0
    # as DCP: a run that failed before writing anything says only why
    return CaptureResult(files=segments, stats=handler.stats, fields=fields,
                         error=error if error is not None else signals.interrupted(),
                         wrote=bool(segments) or error is None, gaps=len(handler.gaps) - filled)


def _resume(settings: CaptureSettings, note) -> tuple[dict, list]:
    if not settings.resume:
        return {}, []
    committed, leftovers = resume_state(settings.output, hold_gaps=bool(settings.catch_up))
    if committed and note is not None:
        note(f"resuming: committed tokens for {len(committed)} streams from the captures in {settings.output}")
    return committed, leftovers


def _open_writer(opts: LiveOptions, settings: CaptureSettings, committed: dict):
    options = opts.safe_dict()
    options["synapse"] = {"name": opts.name, "replicate": opts.replicate,
                          "streams": opts.streams, "server_name": opts.source.server_name,
                          "catch_up": dict(settings.catch_up),
                          "resumed_from": {f"{s}/{i}": t for (s, i), t in committed.items()}}
    writer = CaptureWriter(settings.output, "synapse", source=opts.source.url, options=options,
                           compression=settings.compression,
                           rotate_size=settings.rotate_size,
                           rotate_interval=settings.rotate_interval)
    return writer, BackgroundWriter(writer), options
