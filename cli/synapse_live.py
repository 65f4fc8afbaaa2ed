"""`dcptool stream|capture synapse://... | synapse+redis://...`: runs the Synapse transports
(protocol/transport/synapse.py) and sends what crosses the wire to stdout (stream) or to
the capture writer (capture)."""

from __future__ import annotations

import asyncio
import os
import time

from dcptool.cli.console import err_console
from dcptool.cli.live import CaptureSettings, LiveOptions
from dcptool.cli.output import iso_ns
from dcptool.cli.view.run_summary import (DURATION, END, MAX_MESSAGES, RunStats, StopSignals, run_and_close,
                                     add_rates, print_stream_summary, stop_reason_for_signal, stream_sink)
from dcptool.protocol.synapse.client import Gap, ServerError, SynapseClient

# Knobs the tests turn down (keep-alive and reconnects); the protocol's own values otherwise.
DEFAULTS = {"ping_interval": 5.0, "timeout": 25.0, "max_reconnects": 5,
            "backoff_base": 0.2, "backoff_cap": 10.0, "connect_timeout": 10.0}

TABLE_COLUMNS = ["frame_no", "conn", "direction", "command", "stream", "instance", "token",
                 "detail"]


def _detail(r: dict) -> str:
    """One readable cell: named row fields, POSITION tokens, or the arguments."""
    if r.get("decode_error"):
        return "error: " + r["decode_error"]
    if r.get("fields"):
        return " ".join(f"{k}={_short(v)}" for k, v in r["fields"].items() if v is not None)
    if r.get("command") == "POSITION":
        return f"{r['prev_token']} -> {r['new_token']}"
    text = r.get("args") or ""
    if r.get("channel"):
        text = f"[{r['channel']}] {text}"
    return text


def _short(v) -> str:
    s = v if isinstance(v, str) else __import__("json").dumps(v, separators=(",", ":"))
    return s   # never cut: the table folds long cells on a terminal and keeps them whole elsewhere


def _safe(text) -> str:
    """Server text for a rich markup string: control characters and markup escaped."""
    from rich.markup import escape

    from dcptool.cli.output import printable
    return escape(printable(text))


def _client(opts: LiveOptions, committed=None) -> SynapseClient:
    src = opts.source
    tcp = src.scheme == "synapse"
    name = opts.name or f"dcptool-{src.host}-{os.getpid()}"
    return SynapseClient(name, expected_server=src.server_name if tcp else None,
                         replicate=opts.replicate, keepalive=tcp,
                         ping_interval=DEFAULTS["ping_interval"], timeout=DEFAULTS["timeout"],
                         committed=committed)


async def _transport(opts: LiveOptions, client: SynapseClient, handler) -> None:
    from dcptool.protocol.transport import synapse as synapse_transport
    src = opts.source

    def backoff(n):
        return synapse_transport.backoff_delay(n, DEFAULTS["backoff_base"], DEFAULTS["backoff_cap"])

    common = dict(max_reconnects=DEFAULTS["max_reconnects"], backoff=backoff,
                  connect_timeout=DEFAULTS["connect_timeout"])
    if src.scheme == "synapse":
        await synapse_transport.run_tcp(src.host, src.port, client, handler, **common)
    else:
        await synapse_transport.run_redis(src.host, src.port, src.server_name, client, handler, db=src.db,
                          password=opts.password, username=opts.user, tls=src.tls,
                          ca_cert=opts.ca_cert, insecure=opts.insecure, **common)


class _Base:
    """Stop conditions and the stderr notes shared by stream and capture."""

    def __init__(self, opts: LiveOptions):
        self.opts = opts
        self.received = 0
        self.deadline = time.monotonic() + opts.duration if opts.duration else None
        self.stop = False
        self.gaps: list[Gap] = []
        self.server_errors: list[str] = []
        self.streams = set(opts.streams) if opts.streams else None
        self.stats = RunStats("synapse", opts.source.url)
        self.client: SynapseClient | None = None

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

    def events(self, events: list) -> None:
        con = err_console()
        for ev in events:
            if isinstance(ev, Gap):
                self.gaps.append(ev)
                con.print(f"[yellow]gap:[/] {_safe(ev.stream)}/{_safe(ev.instance)}: committed {ev.committed}, "
                          f"POSITION {ev.prev_token} -> {ev.new_token} ({ev.kind})", highlight=False)
            elif isinstance(ev, ServerError):
                self.server_errors.append(ev.text)
            elif type(ev).__name__ == "Reconnecting":
                con.print(f"[yellow]reconnecting[/] in {ev.delay:.1f} s: {_safe(ev.reason)}", highlight=False)

    def paused(self) -> bool:
        return False

    def tick(self) -> None:
        pass


GRACE = 1.0   # seconds a stop request may take before the run is cancelled (connecting, back-off):
# a signal ends the command within 2 s (CLI.md)


def _run(opts: LiveOptions, client: SynapseClient, handler, signals: StopSignals) -> None:
    """Run the transport until the handler stops it, an error ends it, or a signal (SIGINT,
    SIGTERM, SIGHUP through `signals`) or --duration asks it to stop."""
    from dcptool.cli.output import note_stop_signals, run_deadline
    run_deadline(opts.duration)

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(_transport(opts, client, handler))
        cancelled_by_us = []

        def stop(reason: str) -> None:
            handler.request_stop(reason)

            def hard_stop():   # connecting or backing off: nothing to close cleanly
                if not task.done():
                    cancelled_by_us.append(True)
                    task.cancel()
            loop.call_later(GRACE, hard_stop)

        def on_signal(signum: int) -> None:
            handler.stats.signum = handler.stats.signum or signum
            loop.call_soon_threadsafe(stop, stop_reason_for_signal(signum))

        signals.attach(loop)
        note_stop_signals()   # a write waiting for stdout's reader still sees the signal
        signals.callbacks.append(on_signal)
        if signals.signum is not None:          # came before the loop ran
            on_signal(signals.signum)
        if opts.duration:
            loop.call_later(opts.duration, stop, DURATION)
        try:
            await task
        except asyncio.CancelledError:
            if not cancelled_by_us:
                raise
        finally:
            signals.callbacks.remove(on_signal)
            signals.detach(loop)

    asyncio.run(main())


def _with_text_ts(batch, ts: str):
    """The batch with `ts` as the contract's text (one instant for the whole batch): no
    datetime objects, which would need pandas for nanoseconds."""
    import pyarrow as pa
    i = batch.schema.get_field_index("ts")
    if i < 0:
        return batch
    arrays = list(batch.columns)
    arrays[i] = pa.array([ts] * batch.num_rows, pa.string())
    return pa.RecordBatch.from_arrays(arrays, names=batch.schema.names)


def _line_bytes(lines, channel) -> int:
    # on TCP each line ends with a newline on the wire; a Redis message is the line itself
    return sum(map(len, lines)) + (len(lines) if channel is None else 0)


# ------------------------------------------------------------------------------ stream

class _StreamHandler(_Base):
    def __init__(self, opts: LiveOptions, sink):
        super().__init__(opts)
        self.sink = sink
        self.frame_no = 0

    def block(self, direction, scan, *, conn, ts_ns, mono_ns, channel=None):
        self.lines(direction, scan.lines(), None, conn=conn, ts_ns=ts_ns, mono_ns=mono_ns,
                   channel=channel)

    def lines(self, direction, lines, split, *, conn, ts_ns, mono_ns, channel=None, errors=None):
        from dcptool.protocol.synapse.rows import decode_row
        from dcptool.replay.store.synapse_batch import build_batch
        batch = build_batch(lines, frame_no=self.frame_no, conn=conn, ts_ns=ts_ns, mono_ns=mono_ns,
                            direction=direction, channel=channel, split=split, errors=errors)
        self.frame_no += len(lines)
        ts = iso_ns(ts_ns)
        rows = _with_text_ts(batch, ts).to_pylist()
        out = []
        shown = 0
        nbytes = 0
        for r, line in zip(rows, lines):
            if direction == "in" and self.stop:
                break
            shown += 1
            nbytes += len(line) + (1 if channel is None else 0)
            if self.streams is not None and r["stream"] is not None and r["stream"] not in self.streams:
                continue      # received (and counted in messages_in), not shown
            raw = r.pop("raw")
            if self.opts.raw:
                r["raw"] = raw
            r["fields"] = None
            if r["command"] == "RDATA" and r["row"] is not None:
                try:
                    r["fields"] = decode_row(r["stream"], r["row"])
                except ValueError as exc:  # bad or too deeply nested JSON: the line stays
                    r["fields"] = None
                    r["decode_error"] = r["decode_error"] or f"row: {exc}"
            if r["batch"]:
                r["token"] = "batch"
            if self.sink.fmt != "jsonl":
                r["detail"] = _detail(r)
            out.append(r)
            if direction == "in":
                self.count_in(1)
        self.count(direction, conn, shown, nbytes)
        self.sink.write_many(out)
        if self.sink.fmt != "table":
            self.sink.flush()


def run_stream(opts: LiveOptions) -> None:
    from dcptool.cli.output import Sink, default_format
    fmt = default_format(opts.fmt)
    sink = stream_sink(opts, lambda: Sink(fmt, columns=TABLE_COLUMNS if fmt != "jsonl" else None))
    handler = _StreamHandler(opts, sink)
    client = _client(opts)
    handler.client = client
    with StopSignals() as signals:
        _, error = run_and_close(lambda: _run(opts, client, handler, signals), sink)
        stop_exc = error if error is not None else signals.interrupted()
        if handler.streaming or stop_exc is not None and error is None:
            summary = handler.stats.summary(stop_exc, default=END)
            summary.update(gaps=len(handler.gaps), server_errors=len(handler.server_errors))
            add_rates(summary)
            if not isinstance(error, BrokenPipeError):
                print_stream_summary(summary, opts)
    if stop_exc is not None:
        raise stop_exc


# ------------------------------------------------------------------------------ capture

def resume_state(directory: str) -> tuple[dict[tuple[str, str], int], list[str]]:
    """Committed tokens per (stream, instance) from the Synapse captures in ``directory``,
    after leftover in-progress segments are finished (replay/store/resume.py does both, for
    DCP too). Returns (tokens, paths of the segments finished)."""
    from dcptool.replay.store.resume import recover_in_progress, synapse_resume_state
    finished = recover_in_progress(directory)
    return synapse_resume_state([directory]) if os.path.isdir(directory) else {}, finished


class _CaptureHandler(_Base):
    def __init__(self, opts: LiveOptions, bg, progress):
        super().__init__(opts)
        self.bg = bg
        self.frame_no = 0
        self.bytes = 0
        self.progress = progress
        self.client: SynapseClient | None = None
        src = opts.source  # the `node` column: the TCP or Redis server address
        self.node = f"[{src.host}]:{src.port}" if ":" in str(src.host) else f"{src.host}:{src.port}"

    def lines(self, direction, lines, split, *, conn, ts_ns, mono_ns, channel=None, errors=None):
        from dcptool.replay.store.synapse_batch import build_batch
        batch = build_batch(lines, frame_no=self.frame_no, conn=conn, ts_ns=ts_ns,
                            mono_ns=mono_ns, direction=direction, channel=channel, split=split,
                            errors=errors, node=self.node)
        self.frame_no += len(lines)
        self.bytes += sum(map(len, lines))
        self.count(direction, conn, len(lines), _line_bytes(lines, channel))
        self.bg.submit(batch)
        if direction == "in":
            self.count_in(len(lines))

    def block(self, direction, scan, *, conn, ts_ns, mono_ns, channel=None):
        from dcptool.replay.store.synapse_batch import build_batch_scan
        batch = build_batch_scan(scan, frame_no=self.frame_no, conn=conn, ts_ns=ts_ns,
                                 mono_ns=mono_ns, direction=direction, channel=channel, node=self.node)
        self.frame_no += scan.n
        self.bytes += len(scan.buf)
        self.count(direction, conn, scan.n, len(scan.buf))
        self.bg.submit(batch)
        if direction == "in":
            self.count_in(scan.n)

    def paused(self) -> bool:
        if self.bg.error is not None:
            raise self.bg.error
        return self.bg.congested

    def tick(self) -> None:
        if self.bg.error is not None:
            raise self.bg.error
        if self.progress is not None:
            self.progress(self)


def _progress_printer():
    from rich.live import Live
    from rich.text import Text
    con = err_console()
    live = Live(Text(""), console=con, redirect_stdout=False, redirect_stderr=False,
                transient=True, auto_refresh=False)
    state = {"t0": time.monotonic(), "last": (time.monotonic(), 0, 0)}

    def show(h: _CaptureHandler):
        now = time.monotonic()
        t, n, b = state["last"]
        dt = max(1e-6, now - t)
        lps = (h.frame_no - n) / dt
        mbs = (h.bytes - b) / dt / 1e6
        state["last"] = (now, h.frame_no, h.bytes)
        toks = ""
        if h.client is not None:
            items = sorted(h.client.committed().items())[:6]
            toks = "  ".join(f"{s}/{i}={t}" for (s, i), t in items)
        live.update(Text(f"{h.frame_no} lines  {lps:,.0f} lines/s  {mbs:.1f} MB/s  "
                         f"gaps {len(h.gaps)}  {toks}"), refresh=True)

    return live, show


def run_capture(opts: LiveOptions, settings: CaptureSettings) -> None:
    from dcptool.replay.store.background import BackgroundWriter
    from dcptool.replay.store.writer import CaptureWriter, WriterError

    out = settings.output
    committed: dict = {}
    leftovers: list[dict] = []
    if settings.resume:
        committed, leftovers = resume_state(out)
        if committed:
            err_console().print(f"resuming: committed tokens for {len(committed)} streams "
                                f"from the captures in {out}", highlight=False)
    options = opts.safe_dict()
    options["synapse"] = {"name": opts.name, "replicate": opts.replicate,
                          "streams": opts.streams, "server_name": opts.source.server_name,
                          "resumed_from": {f"{s}/{i}": t for (s, i), t in committed.items()}}
    writer = CaptureWriter(out, "synapse", source=opts.source.url, options=options,
                           compression=settings.compression,
                           rotate_size=settings.rotate_size,
                           rotate_interval=settings.rotate_interval)
    bg = BackgroundWriter(writer)
    live = show = None
    if not settings.quiet:
        live, show = _progress_printer()
        live.start()
    handler = _CaptureHandler(opts, bg, show)
    client = _client(opts, committed=committed)
    handler.client = client
    error: BaseException | None = None
    # SIGINT (even when inherited ignored), SIGTERM, SIGHUP: the same clean finish as Ctrl-C
    with StopSignals() as signals:
        try:
            _run(opts, client, handler, signals)
        except BaseException as exc:  # noqa: BLE001 - files are closed first, then re-raised
            error = exc
        finally:
            if live is not None:
                live.stop()
        try:
            segments = bg.close()
        except WriterError as exc:   # what was finished before the disk error is listed as usual
            error = error or exc.with_traceback(None)
            segments = list(writer.segments)
        stop_exc = error if error is not None else signals.interrupted()
        if segments or error is None:   # as DCP: a run that failed before writing anything says only why
            _summary(opts, settings, writer, segments, leftovers, handler, client, stop_exc)
    if stop_exc is not None:
        raise stop_exc


def _summary(opts, settings, writer, segments, leftovers, handler, client, stop_exc) -> None:
    from dcptool.cli.view.progress import print_summary
    summary = {
        **handler.stats.summary(stop_exc, default=END),
        "capture_id": writer.capture_id,
        "finished_leftovers": leftovers,
        "lines": handler.frame_no,
        "received": handler.received,
        "gaps": [{"stream": g.stream, "instance": g.instance, "committed": g.committed,
                  "prev_token": g.prev_token, "new_token": g.new_token, "kind": g.kind}
                 for g in handler.gaps],
        "committed": {f"{s}/{i}": t for (s, i), t in sorted(client.committed().items())},
        "server_errors": handler.server_errors,
    }
    print_summary(segments, json_summary=settings.json_summary,
                  quiet=settings.quiet, extra=summary)
    if handler.gaps and not settings.quiet:
        err_console().print(f"[yellow]{len(handler.gaps)} gap(s) seen[/]", highlight=False)
